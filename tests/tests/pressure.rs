//! Memory pressure on the real kernel (issue 23): PSI triggers on a cgroup's
//! `memory.pressure` fire under page-cache thrash, and the state with its hysteresis
//! comes back to nominal once the thrash stops.
//!
//! Named `kernel_*`: real cgroups, run alone; `CI=true` makes them mandatory.

use std::time::{Duration, Instant};

use ringwatch_tests::cgroup::{PressureCgroup, skip};
use ringwatch_transport::pressure::Level;
use ringwatch_transport::psi::{self, PsiConfig};

/// Waits until the watcher's level is `want` or above (`some` may give way to `full`
/// between two looks).
async fn wait_level(state: &mut tokio::sync::watch::Receiver<psi::PressureState>, want: Level) -> psi::PressureState {
    let reached = tokio::time::timeout(
        ringwatch_tests::STATE_LIMIT,
        state.wait_for(|s| if want == Level::Nominal { s.level == want } else { s.level >= want }),
    )
    .await
    .map(|r| r.map(|s| s.clone()));
    match reached {
        Ok(Ok(s)) => s,
        Ok(Err(_)) => panic!("the watcher ended"),
        Err(_) => panic!("level {} not reached: {:?}", want.name(), *state.borrow()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kernel_psi_triggers_fire_on_page_cache_thrash_and_the_state_calms_down_after_it() {
    let test = "kernel_psi_triggers_fire_on_page_cache_thrash_and_the_state_calms_down_after_it";
    let mut cg = match PressureCgroup::new("psi", 64 << 20) {
        Ok(c) => c,
        Err(reason) => return skip(test, &reason),
    };
    let cfg = PsiConfig { file: Some(cg.pressure_file()), ..PsiConfig::default() };
    let mut w = psi::start(&cfg).expect("watcher");
    assert_eq!(w.state.borrow().level, Level::Nominal);

    // Two page-cache thrashers over an 80 MiB file in a 64 MiB memcg.
    let dir = ringwatch_tests::repo_root().join("target");
    let started = Instant::now();
    cg.thrash(&dir, 80 << 20, 2);
    let s = wait_level(&mut w.state, Level::Some).await;
    let onset = started.elapsed();
    println!("entered {} after {onset:?}: {:?}", s.level.name(), s.reading);
    assert!(s.fired[0] >= 1, "a some trigger fired: {s:?}");
    assert!(s.reading.some.total_us > 0, "stall time read through the trigger fd: {s:?}");

    // The thrash stops: after three quiet 2 s windows the state steps down to nominal
    // (from full through some, if full was reached).
    cg.stop_all();
    let stopped = Instant::now();
    let s = wait_level(&mut w.state, Level::Nominal).await;
    let calm = stopped.elapsed();
    println!("back to nominal {calm:?} after the thrash stopped; {} transitions, fired {:?}", s.transitions, s.fired);
    assert!(calm >= Duration::from_secs(4), "left only after quiet windows, not at once: {calm:?}");
    assert!(s.transitions >= 2, "{s:?}");
    assert!(!w.task.is_finished(), "the watcher keeps running");
    w.task.abort();
}

/// A cluster of in-process shippers on a simulated scenario; node 0's shipper watches a
/// cgroup under real page-cache thrash (the shipper itself runs outside it: what is
/// tested is that real PSI triggers move its shedding, and that the shedding is
/// accounted end to end). Bulk's share under pressure is 0 % so every bulk batch cut
/// while it lasts is shed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kernel_real_pressure_sheds_bulk_as_psi_shed_keeps_p0_and_the_aggregator_counts_the_same() {
    use aggregator::api::dto::{NodesDto, VerdictsDto};
    use aggregator::{Aggregator, AggregatorConfig};
    use loadgen_sim::{SimOptions, builtin};

    use ringwatch_tests::wait_nodes;
    use ringwatch_tests::{TempDir, cert_set, get_json, stop, streams_settled, truth};

    let test = "kernel_real_pressure_sheds_bulk_as_psi_shed_keeps_p0_and_the_aggregator_counts_the_same";
    let mut cg = match PressureCgroup::new("shed", 64 << 20) {
        Ok(c) => c,
        Err(reason) => return skip(test, &reason),
    };
    let dir = TempDir::new("pressure");
    let mut s = builtin::builtin("pipeline-p2p").expect("built in").expect("valid");
    s.duration_ms = 40_000; // long enough for pressure to come and go
    let options = SimOptions { bulk_scale: 1e-4, seed: None };
    let set = cert_set(dir.path(), s.cluster.nodes);
    let agg = Aggregator::start(AggregatorConfig::local(&set)).await.expect("aggregator");
    let start = Instant::now();
    let shippers = ringwatch_tests::spawn_sim_shippers(&s, options, &set, agg.quic_addr, start, |node, cfg, _| {
        if node == 0 {
            cfg.psi = Some(PsiConfig { file: Some(cg.pressure_file()), ..PsiConfig::default() });
            cfg.psi_bulk_share_pct = 0;
        }
    });
    let name = aggregator::certs::node_name(0);
    let node0 = |n: &NodesDto| n.nodes.iter().find(|x| x.name == name).cloned();
    let pressure = move |n: &NodesDto| node0(n).and_then(|x| x.shipper).map(|st| st.pressure);
    let shed = |n: &NodesDto, class: &str| {
        n.nodes
            .iter()
            .filter(|x| x.name == aggregator::certs::node_name(0))
            .flat_map(|x| &x.streams)
            .filter(|st| st.class == class)
            .map(|st| st.lost.get("psi_shed").copied().unwrap_or(0))
            .sum::<u64>()
    };
    wait_nodes(agg.http_addr, "node 0's heartbeats say nominal", |n| pressure(n).as_deref() == Some("nominal")).await;

    cg.thrash(&ringwatch_tests::repo_root().join("target"), 80 << 20, 2);
    let thrash_at = Instant::now();
    let during = wait_nodes(agg.http_addr, "node 0 under pressure", |n| {
        pressure(n).is_some_and(|p| p != "nominal") && shed(n, "p2") > 0
    })
    .await;
    println!("pressure seen at the aggregator {:?} after the thrash began", thrash_at.elapsed());
    assert!(during.nodes.iter().all(|n| n.health != "degraded"), "shedding made a node degraded: {during:?}");

    cg.stop_all();
    wait_nodes(agg.http_addr, "node 0 back to nominal", |n| pressure(n).as_deref() == Some("nominal")).await;
    let truth = truth(&s, options);
    let after = wait_nodes(agg.http_addr, "every stream settled", |n| streams_settled(n, &truth, |_| true)).await;
    let verdicts: VerdictsDto = get_json(agg.http_addr, "/v1/verdicts?limit=100000").await;
    let reports = stop(shippers).await;
    agg.shutdown();

    let r = &reports[0];
    println!(
        "node 0: {} bulk frames shed psi_shed ({} batches), {:?}; aggregator counted {}",
        r.frames_lost_psi_shed,
        r.batches_shed_pressure,
        r.pressure,
        shed(&after, "p2")
    );
    assert!(r.frames_lost_psi_shed > 0, "bulk was shed: {r:?}");
    assert!(r.p3.sheds >= 1 && r.p3.pooled_bytes_freed > 0, "P3 shed: {:?}", r.p3);
    // The shipper names every batch it sheds in a `psi_shed` loss record; one shed while
    // in flight (sent, not yet acked: the spool evicts sent bulk when no unsent bulk is
    // left) may still arrive and be applied, and the aggregator then counts its frames
    // received, not lost. The shipper counts those apart, so the aggregator's count lies
    // between the shed total less them and the total; the streams stay exact (received +
    // lost = delivered, checked below).
    let counted = shed(&after, "p2");
    let floor = r.frames_lost_psi_shed - r.frames_lost_psi_shed_after_send;
    assert!(
        counted > 0 && (floor..=r.frames_lost_psi_shed).contains(&counted),
        "the aggregator counts {counted} of {} shed ({} of them after their batch was sent)",
        r.frames_lost_psi_shed,
        r.frames_lost_psi_shed_after_send
    );
    assert_eq!(shed(&after, "p0") + shed(&after, "p1"), 0, "P0 and P1 are never shed");
    let p = r.pressure.as_ref().expect("the watcher ran");
    assert!(p.fired[0] >= 1 && p.transitions >= 2, "{p:?}");
    // P0 intact on every node, bulk exact: received + lost = what the generator delivered
    // to the ring, and only node 0 lost any (psi_shed only).
    for t in &truth.streams {
        let name = aggregator::certs::node_name(t.node);
        let n = after.nodes.iter().find(|n| n.name == name).expect("node");
        let got = n.streams.iter().find(|x| x.epoch == t.epoch && x.stream_id == t.stream_id).expect("stream");
        if t.class == "p0" || t.node != 0 {
            assert_eq!((got.received, got.lost_total), (t.delivered, 0), "{name} {:#x} ({})", t.stream_id, t.class);
        } else {
            assert_eq!(got.received + got.lost_total, t.delivered, "{name} {:#x}", t.stream_id);
            assert_eq!(got.lost_total, got.lost.get("psi_shed").copied().unwrap_or(0), "{:?}", got.lost);
        }
        assert_eq!(got.received + got.lost_total + got.sampled_out, t.generated, "{name} {:#x}", t.stream_id);
    }
    assert!(after.nodes.iter().all(|n| n.health != "degraded"), "{after:?}");
    for v in &verdicts.verdicts {
        assert!(!v.outcome.starts_with("stuck") && !v.outcome.starts_with("not_joined"), "{v:?}");
    }
}

/// Reads a cgroup's `cgroup.freeze` (what the throttle wrote: 1 frozen, 0 thawed).
fn freeze_of(cg: &std::path::Path) -> String {
    std::fs::read_to_string(cg.join("cgroup.freeze")).map(|s| s.trim().to_owned()).unwrap_or_default()
}

/// The shipper, told to throttle one background cgroup (P3), watches a cgroup in which
/// that background cgroup runs a page-cache hog and an unlisted sibling idles: the
/// listed one is frozen when pressure enters `some`, and thawed only after the
/// hysteresis's quiet windows once the freeze ended the stall; the unlisted one is never
/// written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kernel_the_throttle_freezes_a_listed_background_cgroup_under_pressure_and_thaws_it_after_the_hysteresis() {
    use aggregator::{Aggregator, AggregatorConfig};
    use loadgen_sim::{SimOptions, builtin};
    use node_shipper::config::Source;
    use node_shipper::core::throttle::Tier;
    use node_shipper::driver::RunOptions;
    use node_shipper::source::SimSource;
    use ringwatch_tests::{STATE_LIMIT, TempDir, cert_set, shipper_config, spawn_shipper, stop};

    let test =
        "kernel_the_throttle_freezes_a_listed_background_cgroup_under_pressure_and_thaws_it_after_the_hysteresis";
    let mut cg = match PressureCgroup::new("throttle", 64 << 20) {
        Ok(c) => c,
        Err(reason) => return skip(test, &reason),
    };
    let bg = cg.child("batch");
    let other = cg.child("other");
    if !bg.join("cgroup.freeze").exists() {
        return skip(test, "no cgroup.freeze in cgroup v2 children (kernel < 5.2)");
    }
    cg.spawn_in(&other, "while :; do sleep 0.2; done");

    let dir = TempDir::new("throttle");
    let mut s = builtin::builtin("pipeline-p2p").expect("built in").expect("valid");
    s.duration_ms = 120_000;
    let options = SimOptions { bulk_scale: 1e-5, seed: None };
    let set = cert_set(dir.path(), s.cluster.nodes);
    let agg = Aggregator::start(AggregatorConfig::local(&set)).await.expect("aggregator");
    let source = SimSource::new(&s, options, 0, Instant::now()).expect("sim");
    let placeholder = Source::Sim { scenario: s.name.clone(), node: 0, bulk_scale_ppm: 0, seed: None };
    let mut cfg = shipper_config(&set, agg.quic_addr, 0, placeholder);
    cfg.psi = Some(PsiConfig { file: Some(cg.pressure_file()), ..PsiConfig::default() });
    cfg.throttle = vec![(Tier::P3, bg.clone())];
    let shipper = spawn_shipper(cfg, Box::new(source), RunOptions::default());

    // Watches the two cgroups' freeze files every 20 ms while waiting for `want` on the
    // listed one; the unlisted one must read 0 at every look.
    let watch = |want: &'static str| {
        let (bg, other) = (bg.clone(), other.clone());
        async move {
            let until = Instant::now() + STATE_LIMIT;
            loop {
                assert_eq!(freeze_of(&other), "0", "the unlisted cgroup was touched");
                if freeze_of(&bg) == want {
                    return Instant::now();
                }
                assert!(Instant::now() < until, "{} never read {want}", bg.display());
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    cg.thrash_in(&bg, &ringwatch_tests::repo_root().join("target"), 80 << 20, 2);
    let hog_at = Instant::now();
    let frozen_at = watch("1").await;
    let events = std::fs::read_to_string(bg.join("cgroup.events")).unwrap_or_default();
    println!("frozen {:?} after the hog began; cgroup.events: {}", frozen_at - hog_at, events.replace('\n', " "));
    let thawed_at = watch("0").await;
    let held = thawed_at - frozen_at;
    println!("thawed {held:?} after the freeze (the stall ended with it; 3 quiet 2 s windows)");
    assert!(held >= Duration::from_secs(4), "released only after quiet windows, not at once: {held:?}");

    cg.stop_all();
    let reports = stop(vec![shipper]).await;
    agg.shutdown();
    let t = reports[0].throttle.as_ref().expect("the throttle in the report");
    println!("throttle: {t:?}");
    assert!(t.holds >= 1 && t.releases >= 1 && t.errors == 0, "{t:?}");
    assert_eq!(t.holds, t.releases, "everything held was released by the end: {t:?}");
    assert!(t.cgroups.iter().all(|c| c.path == bg.display().to_string() && !c.held), "{t:?}");
    assert_eq!(freeze_of(&other), "0");
}

/// The aggregator under real memory pressure (its watcher on a cgroup with page-cache
/// thrash; the process itself outside it): it sheds its own P3 — the verdict store keeps
/// a quarter of its retention (here 120 s → 30 s), what goes for that counted apart in
/// `/healthz` and `/v1/ingest` — and stays healthy; once the pressure ends the store's
/// configured limits apply again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kernel_the_aggregator_sheds_its_verdict_store_under_pressure_and_restores_its_limits_after() {
    use aggregator::api::dto::{HealthzDto, IngestDto, VerdictsDto};
    use aggregator::{Aggregator, AggregatorConfig};
    use loadgen_sim::{SimOptions, builtin};
    use ringwatch_tests::{TempDir, cert_set, stop, streams_settled, truth, wait_json, wait_nodes};

    let test = "kernel_the_aggregator_sheds_its_verdict_store_under_pressure_and_restores_its_limits_after";
    let mut cg = match PressureCgroup::new("aggregator", 64 << 20) {
        Ok(c) => c,
        Err(reason) => return skip(test, &reason),
    };
    let dir = TempDir::new("agg-pressure");
    let s = builtin::builtin("pipeline-p2p").expect("built in").expect("valid");
    let options = SimOptions { bulk_scale: 1e-5, seed: None };
    let set = cert_set(dir.path(), s.cluster.nodes);
    let mut cfg = AggregatorConfig::local(&set);
    cfg.store.retention_ns = 120_000_000_000;
    cfg.psi = Some(PsiConfig { file: Some(cg.pressure_file()), ..PsiConfig::default() });
    let agg = Aggregator::start(cfg).await.expect("aggregator");
    let level = |h: &HealthzDto| h.pressure.as_ref().map(|p| p.level.clone());
    wait_json(agg.http_addr, "/healthz", "the watcher armed, nominal", |h: &HealthzDto| {
        level(h).as_deref() == Some("nominal")
    })
    .await;
    let shippers = ringwatch_tests::spawn_sim_shippers(&s, options, &set, agg.quic_addr, Instant::now(), |_, _, _| {});
    let truth = truth(&s, options);
    wait_nodes(agg.http_addr, "every stream settled", |n| streams_settled(n, &truth, |_| true)).await;
    let _ = stop(shippers).await;
    let before: VerdictsDto = ringwatch_tests::get_json(agg.http_addr, "/v1/verdicts?limit=1").await;
    println!("verdicts held before the pressure: {:?}", before.stored);

    cg.thrash(&ringwatch_tests::repo_root().join("target"), 80 << 20, 2);
    // Ops older than a quarter of the retention (30 s) go while the pressure lasts.
    let h = wait_json(agg.http_addr, "/healthz", "the store shed for pressure", |h: &HealthzDto| {
        h.pressure.as_ref().is_some_and(|p| p.store_ops_shed > 0)
    })
    .await;
    let p = h.pressure.clone().expect("pressure");
    println!("under pressure: {p:?}");
    assert_eq!(h.status, "ok", "shedding P3 is not a fault: {h:?}");
    assert!(p.p3_sheds >= 1 && p.level != "nominal", "{p:?}");
    let ingest: IngestDto = ringwatch_tests::get_json(agg.http_addr, "/v1/ingest").await;
    assert!(
        ingest.evictions.get("store.ops_shed_pressure").copied() >= Some(p.store_ops_shed),
        "{:?}",
        ingest.evictions
    );
    assert_eq!(ingest.evictions.get("store.ops_aged_out").copied(), Some(0), "not counted as retention");
    let during: VerdictsDto = ringwatch_tests::get_json(agg.http_addr, "/v1/verdicts?limit=1").await;
    assert!(during.stored < before.stored, "held {:?} → {:?}", before.stored, during.stored);

    cg.stop_all();
    let h = wait_json(agg.http_addr, "/healthz", "back to nominal", |h: &HealthzDto| {
        level(h).as_deref() == Some("nominal")
    })
    .await;
    println!("after: {:?}", h.pressure);
    assert_eq!(h.status, "ok");
    agg.shutdown();
}
