use ringwatch_tests::pair::{NetConfig, Pair, PairConfig};

#[test]
fn scratch_measure() {
    let secs: u64 = std::env::var("PAIR_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(10);
    let scale: f64 = std::env::var("PAIR_SCALE").ok().and_then(|v| v.parse().ok()).unwrap_or(1e-4);
    let px: f64 = std::env::var("PAIR_PERIOD_X").ok().and_then(|v| v.parse().ok()).unwrap_or(1.0);
    let poll: u64 = std::env::var("PAIR_POLL_MS").ok().and_then(|v| v.parse().ok()).unwrap_or(1);
    let mut s = loadgen_sim::builtin::builtin("demo").unwrap().unwrap();
    s.duration_ms = secs * 1000;
    s.faults.clear();
    for c in &mut s.comms {
        for o in &mut c.ops {
            o.period_ms *= px;
        }
    }
    let t0 = std::time::Instant::now();
    let pair = Pair::new(PairConfig {
        scenario: s,
        options: loadgen_sim::SimOptions { bulk_scale: scale, seed: None },
        net: NetConfig::default(),
        faults: vec![],
        settle_ns: 20_000_000_000,
        poll_ns: poll * 1_000_000,
        map_check_ns: 60_000_000_000,
    });
    let t1 = t0.elapsed();
    let r = pair.run();
    println!("setup {t1:?}, total {:?}", t0.elapsed());
    println!("{:#?}", r.verdicts);
    println!("maps {:?}", r.maps);
    println!("net {:?}", r.net);
    println!("ingest {:?}", r.ingest);
    println!("matcher {:?}", r.matcher);
    println!("timer turns {}", r.timer_turns);
    for c in &r.conservation { println!("{c:?}"); }
    for sh in &r.shippers { println!("node {} from_sim {} in {} acked {} conns {} unacked {:?}", sh.node, sh.frames_from_sim, sh.stats.frames_in, sh.stats.frames_acked, sh.connections, sh.unacked.frames); }
}
