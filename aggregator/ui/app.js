// ringwatch's live page: the node × GPU grid, per-node loss timelines, the latest
// collectives, live from /v1/events. Plain JS, no dependencies. Events are read through
// fetch with a streamed body (not EventSource) so the API's bearer token can be sent;
// the stream resumes with Last-Event-ID after a disconnect, and a `gap` event (evicted
// ids, or an aggregator restart) is shown and answered by re-listing.
'use strict';
(() => {
  const WINDOW_MS = 60000;
  // Every API request gives up after this; the event stream after this long without a
  // byte (the aggregator sends a heartbeat comment every events_heartbeat_ms, 15 s).
  const REQUEST_TIMEOUT_MS = 10000;
  const STREAM_SILENCE_MS = 45000;
  const MAX_BUFFER = 1 << 20;
  const RECENT_OPS = 8;
  // Ranks no frame tied to a GPU are kept under the all-zero uuid.
  const NO_UUID = '0'.repeat(32);
  const HEALTH_TEXT = {
    healthy: 'healthy',
    healthy_lossy: 'telemetry loss — healthy',
    suspect: 'suspect',
    degraded: 'degraded',
    silent: 'silent',
    unreachable: 'unreachable',
  };
  const S = {
    token: null,
    nodes: [],
    asOf: null,
    fetchedAt: 0,
    lastId: null,
    lastEventAt: 0,
    apiError: null,
    bands: new Map(), // node -> [{from, to, band}]: bulk loss bands (aggregator ms)
    marks: new Map(), // node -> [{at, health, gpu}]: health changes (aggregator ms)
    p0: new Map(), // node -> [{at, frames}]: P0 loss events (aggregator ms)
    p0Events: new Map(), // node -> P0 loss events seen (a count)
    gapsAt: [], // aggregator ms of the gaps this page's stream had
    evidence: new Map(), // `${node}/${uuid}` -> the latest final verdict that is not `completed`
    recentOps: [], // collective ids of the latest verdicts, newest first
    colls: [],
    collsAt: 0,
    frozen: false,
    errors: [],
    gaps: 0,
    reconnects: 0,
    selected: null,
    watching: false,
    inflight: null,
  };
  const $ = (id) => document.getElementById(id);
  const esc = (v) => String(v ?? '').replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
  const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
  const pct = (x) => (x == null ? '—' : `${(x * 100).toFixed(x >= 0.999 || x === 0 ? 1 : 2)} %`);
  const healthText = (h) => HEALTH_TEXT[h] ?? h ?? 'unknown';
  const healthClass = (h) => (HEALTH_TEXT[h] ? `h-${h}` : 'h-unknown');
  const pushCapped = (list, item, cap) => {
    list.push(item);
    while (list.length > cap) list.shift();
  };
  const noteError = (e) => pushCapped(S.errors, String(e), 50);

  window.addEventListener('error', (e) => noteError(e.message));
  window.addEventListener('unhandledrejection', (e) => noteError(e.reason));

  // The aggregator's clock now, estimated from the last list answer.
  function aggNow() {
    return S.asOf ? S.asOf.aggregator_ms + (performance.now() - S.fetchedAt) : 0;
  }

  class Unauthorized extends Error {}

  function headers(extra) {
    const h = { ...(extra || {}) };
    if (S.token) h.Authorization = `Bearer ${S.token}`;
    return h;
  }

  async function api(path) {
    const r = await fetch(path, { headers: headers(), cache: 'no-store', signal: AbortSignal.timeout(REQUEST_TIMEOUT_MS) });
    if (r.status === 401) throw new Unauthorized(path);
    if (!r.ok) {
      const body = await r.json().catch(() => ({}));
      throw new Error(`${path}: HTTP ${r.status}${body.error ? ` (${body.error})` : ''}`);
    }
    return r.json();
  }

  function setConn(state, why) {
    const c = $('conn');
    c.dataset.state = state;
    const words = {
      connecting: 'connecting…',
      live: 'live',
      reconnecting: 'reconnecting…',
      unauthorized: 'API token needed',
      error: 'error',
    };
    c.textContent = words[state] + (why ? ` (${why})` : '');
  }

  function notice(text) {
    const n = document.createElement('div');
    n.className = 'notice';
    n.textContent = `${new Date().toLocaleTimeString()}: ${text}`;
    const box = $('notices');
    box.prepend(n);
    while (box.children.length > 5) box.lastChild.remove();
  }

  // ---- list state -------------------------------------------------------------------

  // One list request at a time: callers share the one in flight.
  function refresh() {
    if (!S.inflight) {
      S.inflight = doRefresh().finally(() => {
        S.inflight = null;
      });
    }
    return S.inflight;
  }

  async function doRefresh() {
    let nodes;
    try {
      nodes = await api('/v1/nodes');
      S.apiError = null;
    } catch (e) {
      if (!(e instanceof Unauthorized)) S.apiError = e.message;
      renderAsOf();
      throw e;
    }
    if (S.frozen) return;
    S.nodes = nodes.nodes;
    S.asOf = nodes.as_of;
    S.fetchedAt = performance.now();
    if (!S.lastId && nodes.as_of.event_id) S.lastId = nodes.as_of.event_id;
    prune();
    renderGrid();
    renderAsOf();
    if (performance.now() - S.collsAt > 5000) {
      S.collsAt = performance.now();
      refreshCollectives().catch(report);
    }
  }

  // What the page keeps per node is for the nodes the aggregator lists.
  function prune() {
    const names = new Set(S.nodes.map((n) => n.name));
    for (const m of [S.bands, S.marks, S.p0, S.p0Events]) {
      for (const k of m.keys()) if (!names.has(k)) m.delete(k);
    }
    for (const k of S.evidence.keys()) if (!names.has(k.split('/')[0])) S.evidence.delete(k);
    const old = aggNow() - WINDOW_MS;
    while (S.gapsAt.length && S.gapsAt[0] < old) S.gapsAt.shift();
  }

  let pending = null;
  function refreshSoon() {
    if (pending) return;
    pending = setTimeout(() => {
      pending = null;
      refresh().catch(report);
    }, 2000);
  }

  async function refreshCollectives() {
    const ids = S.recentOps.slice();
    const details = await Promise.all(ids.map((id) => api(`/v1/collectives/${encodeURIComponent(id)}`).catch(() => null)));
    S.colls = details.filter((d) => d);
    renderCollectives();
  }

  function report(e) {
    if (e instanceof Unauthorized) {
      setConn('unauthorized');
      $('auth').hidden = false;
    }
  }

  // ---- rendering --------------------------------------------------------------------

  function p0Counts(n) {
    let lost = 0;
    let received = 0;
    for (const s of n.streams || []) {
      if (s.class !== 'p0') continue;
      lost += s.lost_total;
      received += s.received;
    }
    return [lost, received];
  }

  function gpuHealth(n, g) {
    return n.liveness === 'silent' || n.liveness === 'unreachable' ? n.liveness : g.health;
  }

  function timeline(n, now) {
    const x = (ms) => Math.max(0, Math.min(100, 100 - ((now - ms) / WINDOW_MS) * 100));
    const bar = (cls, from, to, title) => {
      if (to < now - WINDOW_MS) return '';
      const l = x(from);
      const w = Math.max(0.8, x(to) - l);
      return `<i class="${cls}" style="left:${l.toFixed(2)}%;width:${w.toFixed(2)}%" title="${esc(title)}"></i>`;
    };
    let h = '';
    for (const b of S.bands.get(n.name) || []) {
      h += bar('k-bulk', b.from, b.to ?? now, `bulk loss ${b.band}`);
    }
    for (const g of n.knowledge_gaps || []) {
      h += bar('k-gap', g.from_ms, g.to_ms, `the aggregator's own knowledge gap (a restart) ${g.from_ms}–${g.to_ms} ms: not frame loss`);
    }
    for (const at of S.gapsAt) {
      h += bar('k-gap', at - 500, at, 'this page missed events here (a gap in its stream)');
    }
    for (const p of S.p0.get(n.name) || []) {
      h += bar('k-p0', p.at - 500, p.at, `${p.frames} P0 frames lost (reported then)`);
    }
    for (const m of S.marks.get(n.name) || []) {
      if (m.at < now - WINDOW_MS) continue;
      h += `<i class="k-verdict" style="left:${x(m.at).toFixed(2)}%" title="${esc(`${m.gpu ? `GPU ${m.gpu.slice(0, 8)}` : 'node'}: ${healthText(m.health)}`)}"></i>`;
    }
    return h;
  }

  function gpuTitle(n, g) {
    const h = gpuHealth(n, g);
    const v = S.evidence.get(`${n.name}/${g.gpu_uuid}`);
    let t = g.gpu_uuid === NO_UUID
      ? `${n.name}, ranks without a GPU uuid (no frame named their GPU): ${healthText(h)}`
      : `${n.name} GPU ${g.gpu_uuid}: ${healthText(h)}`;
    if (h === 'degraded' || h === 'suspect') t += v ? ` — ${v.outcome}: ${v.evidence}` : ' — click for the evidence';
    if (h === 'healthy_lossy') t += ' — frames were lost; the GPU completed its work';
    if (h === 'silent' || h === 'unreachable') t += ' — no frames or heartbeats from the node; nobody is blamed';
    return t;
  }

  function row(n, now) {
    const named = (n.gpus || []).filter((g) => g.gpu_uuid !== NO_UUID);
    const unnamed = (n.gpus || []).filter((g) => g.gpu_uuid === NO_UUID);
    const cells = named.concat(unnamed)
      .map((g) => {
        const h = gpuHealth(n, g);
        const label = g.gpu_uuid === NO_UUID ? '?' : g.gpu_uuid.slice(0, 4);
        return `<span class="cell ${healthClass(h)}" data-uuid="${esc(g.gpu_uuid)}" data-health="${esc(h)}" title="${esc(gpuTitle(n, g))}" aria-label="${esc(healthText(h))}">${esc(label)}</span>`;
      })
      .join('') || '<small>no GPU verdicts yet</small>';
    const [lost, received] = p0Counts(n);
    const cov = n.bulk ? pct(n.bulk.coverage) : '—';
    const sh = n.shipper;
    const pressure = sh ? `${esc(sh.pressure)}${sh.shed_tier ? ` (shed tier ${sh.shed_tier})` : ''}, spool ${(sh.spool_bytes / 1048576).toFixed(1)}/${(sh.spool_cap_bytes / 1048576).toFixed(0)} MiB` : '—';
    return `<tr data-node="${esc(n.name)}" data-health="${esc(n.health)}"><th title="${esc(n.node_id)}">${esc(n.name)}<br><small class="nh">${esc(healthText(n.health))}</small></th>`
      + `<td>${esc(n.liveness)}${n.connected ? '' : ', disconnected'}</td><td>${cells}</td>`
      + `<td><div class="tl">${timeline(n, now)}</div></td><td>${cov}</td><td>${lost} / ${received}</td><td>${pressure}</td></tr>`;
  }

  function renderGrid() {
    const now = aggNow();
    $('grid').tBodies[0].innerHTML = S.nodes.map((n) => row(n, now)).join('');
    const by = {};
    for (const n of S.nodes) by[n.health] = (by[n.health] || 0) + 1;
    $('counts').textContent = `${S.nodes.length} nodes: ${Object.entries(by).map(([k, v]) => `${healthText(k)} ${v}`).join(' · ')}`;
  }

  function renderAsOf() {
    if (!S.asOf) return;
    const age = Math.round((performance.now() - S.fetchedAt) / 1000);
    const w = S.asOf.p0_watermark_min_node ? ` · P0 watermark held by ${S.asOf.p0_watermark_min_node}` : '';
    const last = S.lastEventAt ? ` · last event ${Math.round((performance.now() - S.lastEventAt) / 1000)} s ago` : '';
    const err = S.apiError ? ` · API error: ${S.apiError}` : '';
    $('asof').textContent = `as of ${new Date(Date.now() - age * 1000).toLocaleTimeString()} (local, ${age} s ago; epoch ${S.asOf.aggregator_epoch})${w}${last}${err}`;
    $('asof').classList.toggle('stale', age > 10 || S.apiError != null);
  }

  function opName(op) {
    return `${op.kind} ${op.comm.slice(0, 8)}#${op.seq}`;
  }

  function renderCollectives() {
    $('colls').tBodies[0].innerHTML = S.colls
      .map((d) => {
        const done = d.verdicts.filter((v) => v.outcome === 'completed').length;
        const finals = d.verdicts.filter((v) => v.final).length;
        const ranks = (done ? `<span class="o o-completed">completed ×${done}</span>` : '')
          + d.verdicts
            .filter((v) => v.outcome !== 'completed')
            .map((v) => `<span class="o o-${esc(v.outcome.split('(')[0])}" title="${esc(`${v.node ?? '?'} ${v.gpu_uuid}: ${v.evidence}`)}">r${v.rank} ${esc(v.outcome)}${v.final ? '' : '?'}</span>`)
            .join('');
        const decided = Math.max(0, ...d.verdicts.map((v) => v.decided_at_ms));
        return `<tr><td>${esc(opName(d.op))}</td><td>${esc(d.state)} (${finals}/${d.verdicts.length} final)</td><td>${decided} ms</td><td>${ranks}</td></tr>`;
      })
      .join('') || '<tr><td colspan="4">no verdict since this page opened</td></tr>';
  }

  async function showGpu(uuid) {
    S.selected = uuid;
    const d = await api(`/v1/gpus/${encodeURIComponent(uuid)}`);
    if (S.selected !== uuid) return;
    const node = S.nodes.find((n) => n.name === d.node);
    const h = node ? gpuHealth(node, { health: d.health }) : d.health;
    $('detail').hidden = false;
    $('detail-title').textContent = `${d.node} · GPU ${uuid.slice(0, 12)}… · ${healthText(h)}`;
    const owners = d.owners.map((o) => `pid ${o.pid}${o.pod_uid ? ` pod ${o.pod_uid}` : ''}${o.slurm_job_id != null ? ` job ${o.slurm_job_id}` : ''}`).join(', ') || 'none known';
    const vs = d.recent_verdicts
      .map((v) => `<li><b>${esc(v.outcome)}</b>${v.final ? ' (final)' : ''} in ${esc(opName(v.op))} rank ${v.rank}: ${esc(v.evidence)}${v.loss_intervals.length ? ` · loss intervals ${esc(v.loss_intervals.join(', '))}` : ''}</li>`)
      .join('');
    $('detail-body').innerHTML = `<p>uuid ${esc(uuid)}<br>owners: ${esc(owners)}</p><h3>Recent verdicts (newest first)</h3><ul id="detail-verdicts">${vs || '<li>none in the event log</li>'}</ul>`;
  }

  // ---- events -----------------------------------------------------------------------

  // Node events carry no time: the page places them when it received them.
  function onEvent(kind, id, data) {
    if (id) S.lastId = id;
    S.lastEventAt = performance.now();
    if (S.frozen) return;
    const d = data ? JSON.parse(data) : {};
    const now = aggNow();
    switch (kind) {
      case 'verdict':
      case 'revision':
        if (d.node && d.gpu_uuid) {
          const key = `${d.node}/${d.gpu_uuid}`;
          if (d.final && d.outcome !== 'completed') S.evidence.set(key, d);
        }
        if (d.collective_id) {
          S.recentOps = [d.collective_id].concat(S.recentOps.filter((x) => x !== d.collective_id)).slice(0, RECENT_OPS);
        }
        break;
      case 'health': {
        const marks = S.marks.get(d.node) || [];
        pushCapped(marks, { at: now, health: d.health, gpu: d.gpu_uuid }, 64);
        S.marks.set(d.node, marks);
        if (d.gpu_uuid && (d.health === 'healthy' || d.health === 'healthy_lossy')) S.evidence.delete(`${d.node}/${d.gpu_uuid}`);
        refreshSoon();
        break;
      }
      case 'loss_rate': {
        const bands = S.bands.get(d.node) || [];
        const open = bands.find((b) => b.to == null);
        if (open) open.to = now;
        if (d.band !== 'none' && d.band !== 'below_0.1%') pushCapped(bands, { from: now, to: null, band: d.band }, 32);
        S.bands.set(d.node, bands);
        break;
      }
      case 'p0_loss': {
        const lost = S.p0.get(d.node) || [];
        pushCapped(lost, { at: now, frames: d.frames_lost }, 64);
        S.p0.set(d.node, lost);
        S.p0Events.set(d.node, (S.p0Events.get(d.node) || 0) + 1);
        refreshSoon();
        break;
      }
      case 'gap':
        S.gaps += 1;
        // What the missed events would have closed is unknown: open bands end here.
        for (const bands of S.bands.values()) for (const b of bands) if (b.to == null) b.to = now;
        pushCapped(S.gapsAt, now, 16);
        notice(d.reason === 'other_instance'
          ? `the aggregator restarted (or another instance answered): events after ${d.from_id} are not available; the page re-listed its state`
          : `${d.missed ?? 'some'} events were evicted before this page read them (${d.from_id} … ${d.to_id}); the page re-listed its state`);
        refresh().catch(report);
        break;
      default:
        refreshSoon();
    }
  }

  function onBlock(block) {
    let kind = 'message';
    let id = null;
    const data = [];
    for (const line of block.split('\n')) {
      if (line === '' || line.startsWith(':')) continue;
      const at = line.indexOf(':');
      const field = at < 0 ? line : line.slice(0, at);
      const value = at < 0 ? '' : line.slice(at + 1).replace(/^ /, '');
      if (field === 'event') kind = value;
      else if (field === 'id') id = value;
      else if (field === 'data') data.push(value);
    }
    if (data.length || id) onEvent(kind, id, data.join('\n'));
    else S.lastEventAt = performance.now();
  }

  async function readStream() {
    const ctl = new AbortController();
    let watchdog = setTimeout(() => ctl.abort(new Error('no byte for 45 s')), STREAM_SILENCE_MS);
    const extra = S.lastId ? { 'Last-Event-ID': S.lastId } : {};
    try {
      const r = await fetch('/v1/events', { headers: headers(extra), cache: 'no-store', signal: ctl.signal });
      if (r.status === 401) throw new Unauthorized('/v1/events');
      if (!r.ok) throw new Error(`/v1/events: HTTP ${r.status}`);
      setConn('live');
      const reader = r.body.getReader();
      try {
        const dec = new TextDecoder();
        let buf = '';
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          clearTimeout(watchdog);
          watchdog = setTimeout(() => ctl.abort(new Error('no byte for 45 s')), STREAM_SILENCE_MS);
          buf = (buf + dec.decode(value, { stream: true })).replace(/\r\n?/g, '\n');
          if (buf.length > MAX_BUFFER) throw new Error('an event larger than 1 MiB');
          let i;
          while ((i = buf.indexOf('\n\n')) >= 0) {
            const block = buf.slice(0, i);
            buf = buf.slice(i + 2);
            onBlock(block);
          }
        }
      } finally {
        reader.cancel().catch(() => {});
      }
      throw new Error('the stream ended');
    } finally {
      clearTimeout(watchdog);
    }
  }

  async function watch() {
    if (S.watching) return;
    S.watching = true;
    try {
      if (!S.token) {
        // /healthz needs no token and says whether the API does: ask before a 401.
        const h = await fetch('/healthz', { cache: 'no-store', signal: AbortSignal.timeout(REQUEST_TIMEOUT_MS) })
          .then((r) => r.json())
          .catch(() => null);
        if (h && h.api_token_required) {
          report(new Unauthorized('/healthz'));
          return;
        }
      }
      let backoff = 500;
      for (;;) {
        try {
          if (!S.asOf) await refresh();
          const opened = performance.now();
          try {
            await readStream();
          } finally {
            // A stream that stayed up a while resets the backoff.
            if (performance.now() - opened > 5000) backoff = 500;
          }
        } catch (e) {
          if (e instanceof Unauthorized) {
            report(e);
            return;
          }
          S.reconnects += 1;
          S.lastError = e.message;
          setConn('reconnecting', e.message);
          await sleep(backoff * (0.75 + Math.random() / 2));
          backoff = Math.min(backoff * 2, 5000);
        }
      }
    } finally {
      S.watching = false;
    }
  }

  // ---- start ------------------------------------------------------------------------

  function start() {
    const m = /(?:^#|&)token=([^&]+)/.exec(location.hash);
    if (m) {
      try {
        sessionStorage.setItem('ringwatch-token', decodeURIComponent(m[1]));
      } catch (e) {
        notice(`the #token in the address could not be read: ${e.message}`);
      }
      history.replaceState(null, '', location.pathname + location.search);
    }
    S.token = sessionStorage.getItem('ringwatch-token');
    $('auth').addEventListener('submit', (e) => {
      e.preventDefault();
      S.token = $('token').value.trim();
      sessionStorage.setItem('ringwatch-token', S.token);
      $('auth').hidden = true;
      if (!S.watching) {
        setConn('connecting');
        watch();
      }
    });
    $('grid').addEventListener('click', (e) => {
      const cell = e.target.closest('.cell[data-uuid]');
      if (cell && cell.dataset.uuid !== NO_UUID) showGpu(cell.dataset.uuid).catch(report);
    });
    setInterval(() => {
      renderAsOf();
      if (!S.frozen && S.asOf && performance.now() - S.fetchedAt > 5000) refresh().catch(report);
    }, 1000);
    renderCollectives();
    watch();
  }

  // For tests and operators' consoles: render a /v1/nodes body without the live feed
  // (the 64 × 8 fixture), and what the page saw.
  window.ringwatch = {
    fixture(nodes) {
      S.frozen = true;
      const t0 = performance.now();
      S.nodes = nodes.nodes;
      S.asOf = nodes.as_of;
      S.fetchedAt = performance.now();
      renderGrid();
      // Layout included: reading a size forces it.
      const height = document.body.offsetHeight;
      return { ms: performance.now() - t0, dom_nodes: document.getElementsByTagName('*').length, cells: document.querySelectorAll('#grid .cell').length, height };
    },
    state: () => ({
      conn: $('conn').dataset.state,
      last_error: S.lastError ?? null,
      api_error: S.apiError,
      errors: S.errors.slice(),
      gaps: S.gaps,
      reconnects: S.reconnects,
      last_id: S.lastId,
      nodes: S.nodes.length,
      p0_events: Object.fromEntries(S.p0Events),
      collectives: S.colls.length,
    }),
  };

  start();
})();
