/* The live view of the engine: the KV cache's blocks and the scheduler's
   queues, one frame per engine step (common/metrics/step_events.py says
   what a frame holds).

   Frames come from the server (live: server-sent events from /ui/events)
   or from a recording (replay: ?replay=<url>, or a file opened on the
   page). Either way they land in `frames`, the kept history, and
   `draw(frame)` depends on that one frame only: replay draws a step
   exactly as live did. Every frame is kept; drawing happens at most 10
   times a second.

   Another engine's KV events (`--kv-events`, vLLM's format) come as
   `kv` frames: kv_view.js draws the prefix cache they describe. */
"use strict";
(() => {
  const MAX_FRAMES = 500;      // live: the history kept for stepping back
  const DRAW_EVERY_MS = 100;   // at most 10 drawings a second (and replay's pace)
  const MAX_LIST = 200;        // requests listed per queue (the count tells the rest)
  const KIND = { ".": "free", "c": "cached", "u": "used", "s": "shared" };

  const $ = (id) => document.getElementById(id);
  const params = new URLSearchParams(location.search);

  // ---------------------------------------------------------------- state
  const frames = [];           // kept frames, oldest first
  let config = null;           // the engine's settings (a recording's first line)
  let shown = null;            // the frame drawn now
  let mode = "live";           // "live" (a server) or "replay" (a recording)
  let paused = false;
  let connection = "reconnecting"; // live: "live", "reconnecting" or "ended"
  let replayEnded = false;     // replay: the last frame is drawn
  let checkFirstFrame = false; // a config without started_at: its first frame tells a restart
  let gaps = 0;                // frames the server dropped for this viewer
  let selected = null;         // the request whose block table the side panel shows
  let source = null;           // the EventSource (live)

  // A stable colour per request: a hash of its id picks one of twelve hues,
  // ordered so that req-1, req-2, req-3... differ the most (then shifted a
  // little, for more than twelve requests).
  const HUES = [222, 28, 140, 310, 48, 190, 4, 255, 100, 336, 165, 282];
  function requestHue(requestId) {
    let n = 0;
    for (const ch of requestId) n = (n * 31 + ch.charCodeAt(0)) >>> 0;
    return HUES[n % 12] + (Math.floor(n / 12) % 3) * 7;
  }

  // ch10: with adapters (frames carry `lora`), a request takes its
  // adapter's colour instead: the base model's requests the first hue,
  // each adapter the next, in the order they first appear.
  const adapterOf = new Map();   // request id -> its adapter's name, "" for the base model
  const adapterHues = new Map([["", HUES[0]]]);
  let byAdapter = false;
  function noteAdapter(row) {
    const name = row.lora_name || "";
    if (!adapterOf.has(row.request_id)) adapterOf.set(row.request_id, name);
    if (!adapterHues.has(name)) adapterHues.set(name, HUES[adapterHues.size % 12]);
  }
  function hue(requestId) {
    if (!byAdapter) return requestHue(requestId);
    return adapterHues.get(adapterOf.get(requestId) || "");
  }
  function adapterTag(requestId) {   // " · pirate" after a label, with adapters
    const name = byAdapter ? adapterOf.get(requestId) : "";
    return name ? ` · ${name}` : "";
  }

  // Short labels for long request ids: a served request is
  // "chatcmpl-40f031206c8a453a8f5d735b59510ba7-0", the page writes
  // "40f031-0" (its first 6 hex digits and the choice's number) and keeps
  // the full id in data-request-id and the tooltip. Short ids ("req-3")
  // stay as they are. A label another request of this run already has
  // gets one more digit: two requests never share one. Labels are given
  // as frames arrive, in step order: live and replay give the same ones.
  const SERVED_ID = /^(?:chatcmpl-|cmpl-)?([0-9a-f][0-9a-f-]{7,}?)(-\d{1,4})?$/i;
  const labels = new Map();      // request id -> its label, in this run
  const labelled = new Map();    // label -> the request id that has it

  function labelChoices(id) {    // the labels an id may take, shortest first
    const served = SERVED_ID.exec(id);
    const choices = [];
    if (served) {
      const hex = served[1].replace(/-/g, ""), choice = served[2] || "";
      for (let n = 6; n < hex.length; n++) choices.push(hex.slice(0, n) + choice);
    } else if (id.length > 16) { // another long id: its start
      for (let n = 12; n < id.length; n++) choices.push(id.slice(0, n) + "…");
    }
    return [...choices, id];
  }

  function label(id) {
    if (labels.has(id)) return labels.get(id);
    let text = labelChoices(id).find((choice) => !labelled.has(choice));
    for (let n = 2; text === undefined; n++) if (!labelled.has(`${id}·${n}`)) text = `${id}·${n}`;
    labels.set(id, text);
    labelled.set(text, id);
    return text;
  }

  function labelRequests(frame) { // every request of a frame, in a fixed order
    if (frame.lora) byAdapter = true;
    for (const queue of ["running", "waiting", "preempted", "finished", "batch"]) {
      for (const row of frame[queue] || []) {
        label(row.request_id);
        if (queue !== "finished") noteAdapter(row);
      }
    }
  }

  // JSON numbers beyond 2^53 (vLLM's 64-bit block hashes) lose their last
  // digits as JavaScript numbers: such integers are kept as their exact text.
  function parseJson(text) {
    if (!/\d{16}/.test(text)) return JSON.parse(text);
    return JSON.parse(text, (key, value, context) =>
      Number.isInteger(value) && !Number.isSafeInteger(value) && context ? context.source : value);
  }

  // ------------------------------------------------------- receiving frames
  const kv = makeKvView({ $, element, sizePool, cellText: () => blockText });

  function newHistory() {        // a new run: its own frames, labels and chains
    frames.length = 0;
    labels.clear();
    labelled.clear();
    adapterOf.clear();
    kv.reset();
  }

  // On each connection the server sends its config, then its last frames.
  // The config's started_at (the engine's start) tells a restarted server
  // (a new history) from the same one (its frames merged into ours). An
  // older server sends none: then its first frame tells (see onFrame).
  function onConfig(next) {
    if (mode === "live" && config) {
      const known = next.started_at !== undefined && config.started_at !== undefined;
      if (known && next.started_at !== config.started_at) newHistory();
      checkFirstFrame = !known;
    }
    config = next;
    if (!shown) document.body.classList.toggle("kv", isKv());  // its panels, before any frame
    drawConfig();
    drawStatus();
  }

  const keptFrame = (step) => frames.findLast((f) => f.step === step);
  const sameFrame = (kept, frame) =>
    kept.ts === frame.ts || kept.ts === undefined || frame.ts === undefined;

  function onFrame(frame) {
    const kept = keptFrame(frame.step), latest = frames[frames.length - 1];
    const oldRule = checkFirstFrame;
    checkFirstFrame = false;
    if (kept && sameFrame(kept, frame)) return;           // we have it already
    // Another frame of a step we have, or one older than all we keep: the
    // source started again without a new started_at (another engine's KV
    // events count from 1 again when it restarts). After a config without
    // started_at, the old rule: a step lower than our latest.
    if (kept || (frames.length && frame.step < frames[0].step) ||
        (oldRule && latest && frame.step < latest.step)) newHistory();
    labelRequests(frame);
    let at = frames.length;      // in step order: a reconnect fills what we lack
    while (at > 0 && frames[at - 1].step > frame.step) at--;
    frames.splice(at, 0, frame);
    if (at < frames.length - 1) kv.forgetAfter(frames, at);   // later states depend on it
    if (mode === "live" && frames.length > MAX_FRAMES) {
      kv.keepFirst(frames);      // the cache as it was at the new first frame
      frames.shift();
    }
  }

  // ------------------------------------------------------------------ live
  function connectLive() {
    const query = new URLSearchParams();
    for (const name of ["key", "engine"]) {  // --api-key's key; ch09: which engine
      if (params.get(name)) query.set(name, params.get(name));
    }
    const search = query.toString();
    source = new EventSource("/ui/events" + (search ? "?" + search : ""));
    const setConnection = (state) => { connection = state; drawStatus(); };
    source.onopen = () => setConnection("live");
    // The server went away: EventSource tries again by itself (CONNECTING),
    // unless the server answered with an error (CLOSED: a wrong key...).
    source.onerror = () =>
      setConnection(source.readyState === EventSource.CLOSED ? "ended" : "reconnecting");
    source.addEventListener("config", (e) => onConfig(parseJson(e.data)));
    source.addEventListener("step", (e) => onFrame(parseJson(e.data)));
    source.addEventListener("gap", (e) => {   // the history note shows where
      gaps += JSON.parse(e.data).dropped;
      drawStatus();
    });
  }

  // ---------------------------------------------------------------- replay
  // A recording (--record-events FILE): JSON lines, the config first, then
  // one frame per line ("step", or "kv" for another engine's KV events).
  // It plays from its first frame, 10 a second.
  function loadRecording(text) {
    if (source) source.close();
    mode = "replay";
    newHistory();
    for (const line of text.split("\n")) {
      let record;
      try { record = parseJson(line); } catch { continue; } // blank, or cut short by a crash
      if (record.type === "config") onConfig(record);
      else if (record.type === "step" || record.type === "kv") {
        labelRequests(record);
        frames.push(record);
      }
    }
    paused = false;
    replayEnded = !frames.length;
    if (frames.length) draw(frames[0]); else drawStatus();
  }

  function fetchRecording(url) {
    mode = "replay";
    fetch(url)
      .then((response) => {
        if (!response.ok) throw new Error(`${response.status} ${response.statusText}`);
        return response.text();
      })
      .then(loadRecording)
      .catch((error) => {
        replayEnded = true;
        drawStatus();
        $("history-note").textContent = `could not load ${url}: ${error.message}`;
      });
  }

  // ------------------------------------------------------ playing and steps
  // Ten times a second: live draws the newest frame, replay the next one.
  function tick() {
    if (paused || !frames.length) return;
    if (mode === "live") {
      if (shown !== frames[frames.length - 1]) draw(frames[frames.length - 1]);
    } else if (currentIndex() < frames.length - 1) {
      draw(frames[currentIndex() + 1]);
    } else if (!replayEnded) {
      replayEnded = true;
      drawStatus();
    }
  }

  // Where the drawn frame is in the history (if it left the history, the
  // kept frame with its step number).
  function currentIndex() {
    const i = frames.indexOf(shown);
    if (i >= 0 || !shown) return Math.max(i, 0);
    return Math.max(frames.findIndex((f) => f.step === shown.step), 0);
  }

  function pause() {
    paused = true;
    drawStatus();
  }

  function resume() {
    const atEnd = currentIndex() >= frames.length - 1;
    if (mode === "replay" && atEnd && frames.length) draw(frames[0]); // play again
    paused = false;
    replayEnded = false;
    drawStatus();
  }

  function goTo(index) {             // stepping through the history pauses
    if (!frames.length) return;
    paused = true;
    draw(frames[Math.min(Math.max(index, 0), frames.length - 1)]);
  }

  function show(step) {              // draw the kept frame of that step, paused
    const frame = frames.find((f) => f.step === Number(step));
    if (frame) goTo(frames.indexOf(frame));
    return Boolean(frame);
  }

  function select(requestId) {       // the side panel shows this request's block table
    selected = selected === requestId ? null : requestId;
    if (shown) draw(shown);
  }

  // --------------------------------------------------------------- drawing
  let kvDrawn = false;               // the pool holds kv_view.js's cells
  const isKv = () => (shown ? shown.type === "kv" : Boolean(config && config.source === "kv-events"));

  function draw(frame) {
    shown = frame;
    document.body.dataset.step = frame.step;
    if (isKv() !== kvDrawn) {        // the other mode's cells go, the panels change
      kvDrawn = isKv();
      document.body.classList.toggle("kv", kvDrawn);
      $("pool").replaceChildren();
      blockEls = [];
    }
    if (kvDrawn) {
      kv.draw(frames, frames.indexOf(frame));
      drawStatus();
      return;
    }
    const usedDrawn = drawPool(frame);
    drawQueues(frame);
    drawBatch(frame);
    drawFigures(frame, usedDrawn);
    drawBlockTable(frame);
    drawStatus();
  }

  // The pool: one element per block, made once, then only changed (a pool
  // can have thousands of blocks).
  let blockEls = [];
  let blockText = "none";          // what a block says: "none", "id" or "tokens"
  let sizedFor = 0;                // the cells the pool is sized for
  let owners = [], tokens = [];    // in the drawn frame: each block's first holder, its tokens

  function buildPool(numBlocks) {
    const fragment = document.createDocumentFragment();
    blockEls = [];
    for (let i = 0; i < numBlocks; i++) {
      const el = document.createElement("div");
      el.id = "block-" + i;
      el.dataset.block = i;
      el.className = "block free";
      blockEls.push(el);
      fragment.appendChild(el);
    }
    $("pool").replaceChildren(fragment);
    sizePool(numBlocks);
  }

  // Cells as large as fit: the pool's width, about 40% of the window's
  // height (60% for the KV events' prefix cache, alone on its side).
  function sizePool(cells = sizedFor) {
    sizedFor = cells;
    const pool = $("pool"), n = cells || 1, gap = n > 400 ? 1 : 3;
    const share = document.body.classList.contains("kv") ? 0.6 : 0.4;
    const width = pool.clientWidth, height = Math.max(220, window.innerHeight * share);
    let cell = Math.min(120, Math.floor(Math.sqrt((width * height) / n)));
    while (cell > 6 && Math.ceil(n / Math.floor(width / (cell + gap))) * (cell + gap) > height) cell--;
    pool.style.setProperty("--cell", cell + "px");
    pool.style.setProperty("--gap", gap + "px");
    blockText = cell >= 72 ? "tokens" : cell >= 26 ? "id" : "none";
    pool.classList.toggle("small", cell < 14);    // no borders: colour only
    for (const el of blockEls) el.drawn = null;   // draw every block again
  }

  function drawPool(frame) {
    const n = frame.num_blocks, size = frame.block_size;
    if (blockEls.length !== n) buildPool(n);
    $("pool-title").textContent = `${n} blocks × ${size} tokens`;
    // Who holds each block (the first running request whose block table
    // has it), and how many tokens are in it: block j of a request holds
    // min(block_size, computed - j * block_size) of its computed tokens.
    owners = new Array(n).fill(undefined);
    tokens = new Array(n).fill(0);
    for (const r of frame.running) {
      r.block_table.forEach((b, j) => {
        if (owners[b] === undefined) owners[b] = r.request_id;
        tokens[b] = Math.max(tokens[b], Math.min(size, Math.max(0, r.num_computed_tokens - j * size)));
      });
    }
    const row = frame.running.find((r) => r.request_id === selected);
    const selectedBlocks = new Set(row ? row.block_table : []);
    $("pool").classList.toggle("selecting", selectedBlocks.size > 0);
    let usedDrawn = 0;
    for (let i = 0; i < n; i++) {
      const kind = KIND[frame.blocks[i]] || "free";
      const held = kind === "used" || kind === "shared";
      const owner = held ? owners[i] : undefined;    // none: held by no running request
      if (held) usedDrawn++;
      const text = blockText === "none" ? "" :
        blockText === "tokens" && owner !== undefined ? `${i}\n${tokens[i]} of ${size}` : String(i);
      const look = [kind, owner, tokens[i], selectedBlocks.has(i), text].join("|");
      const el = blockEls[i];
      if (el.drawn === look) continue;               // unchanged since the last drawing
      el.drawn = look;
      el.className = "block " + kind;
      el.textContent = text;
      el.toggleAttribute("data-selected", selectedBlocks.has(i));
      el.toggleAttribute("data-dark", held && (owner === undefined || tokens[i] >= 0.7 * size));
      if (owner === undefined) delete el.dataset.owner; else el.dataset.owner = owner;
      el.style.setProperty("--hue", owner === undefined ? 0 : hue(owner));
      el.style.setProperty("--fill", owner === undefined ? "100%" : (100 * tokens[i]) / size + "%");
    }
    return usedDrawn;
  }

  function describeBlock(i) {        // a block's tooltip
    const kind = KIND[shown.blocks[i]];
    if (kind === "free") return `block ${i}: free`;
    if (kind === "cached") return `block ${i}: free, its tokens kept for the prefix cache`;
    const holder = owners[i] ? `${label(owners[i])} (${owners[i]})` : "no running request";
    return `block ${i}: ${kind === "shared" ? "shared, first holder" : "held by"} ` +
      `${holder}, ${tokens[i]} of ${shown.block_size} tokens`;
  }

  function element(tag, className, text) {
    const el = document.createElement(tag);
    el.className = className;
    el.textContent = text;
    return el;
  }

  // The queues: one chip per request, in the request's colour, its short
  // label shown, its full id in the tooltip.
  function requestItem(requestId, text, title = "") {
    const li = element("li", "", text);
    li.dataset.requestId = requestId;
    li.style.setProperty("--hue", hue(requestId));
    li.title = requestId + (title ? "\n" + title : "");
    li.toggleAttribute("data-selected", requestId === selected);
    return li;
  }

  function fillList(id, rows, item) {
    $(id).replaceChildren(...rows.slice(0, MAX_LIST).map(item));
    $(id + "-count").textContent =
      rows.length > MAX_LIST ? `${rows.length}, first ${MAX_LIST} shown` : rows.length;
  }

  function drawQueues(frame) {
    // "req-3 21+5 ⟲1": 21 prompt tokens, 5 output tokens, preempted once
    const chip = (r) => `${label(r.request_id)} ${r.num_prompt_tokens}+${r.num_output_tokens}` +
      (r.num_preemptions ? ` ⟲${r.num_preemptions}` : "") + adapterTag(r.request_id);
    fillList("running", frame.running, (r) => requestItem(r.request_id, chip(r),
      `${r.block_table.length} blocks, ${r.num_computed_tokens} tokens computed ` +
      `(${r.num_cached_tokens} found in the prefix cache)`));
    fillList("waiting", frame.waiting, (r) => requestItem(r.request_id, chip(r)));
    fillList("preempted", frame.preempted, (r) => requestItem(r.request_id, chip(r),
      "its blocks were freed: its prompt and output will be computed again"));
    fillList("finished", frame.finished, (r) =>
      requestItem(r.request_id, `${label(r.request_id)} (${r.finish_reason})`));
  }

  // The batch: what the step fed, per request, against the step's token budget.
  function drawBatch(frame) {
    const total = frame.batch.reduce((sum, row) => sum + row.num_tokens, 0);
    const budget = (config && config.max_num_batched_tokens) || Math.max(total, 1);
    $("batch-total").textContent = `${total} of ${budget} tokens`;
    $("batch").replaceChildren(...frame.batch.map((row) => {
      const li = requestItem(row.request_id, "");
      li.dataset.kind = row.kind;
      const bar = element("span", "bar", "");
      bar.style.width = Math.min(100, (100 * row.num_tokens) / budget) + "%";
      const drafts = row.num_drafts ? ` (${row.num_drafts} drafts, ${row.num_accepted} kept)` : "";
      li.append(element("span", "who", label(row.request_id) + adapterTag(row.request_id)),
        element("span", "kind", row.kind), bar,
        element("span", "tokens", row.num_tokens + drafts));
      return li;
    }));
    drawAdapters(frame);
    // The prefix cache's changes in this step (vLLM's KV events).
    const count = (type) => (frame.kv_events || []).filter((e) => e.type === type)
      .reduce((sum, e) => sum + e.block_hashes.length, 0);
    const cleared = (frame.kv_events || []).some((e) => e.type === "AllBlocksCleared");
    $("kv-events").textContent = `Prefix cache this step: ${count("BlockStored")} blocks ` +
      `stored, ${count("BlockRemoved")} removed` + (cleared ? ", all cleared" : "");
  }

  // ch10: the step's adapter budget, --max-loras, and who waits for a slot.
  function drawAdapters(frame) {
    const lora = frame.lora;
    $("lora-budget").hidden = !lora;
    if (!lora) return;
    const names = (counts) => Object.entries(counts).map(([name, n]) => `${name} (${n})`)
      .join(", ") || "none";
    $("lora-budget").textContent = `Adapters in the batch: ${Object.keys(lora.running_lora_adapters).length} ` +
      `of ${lora.max_loras} slots: ${names(lora.running_lora_adapters)}; ` +
      `waiting: ${names(lora.waiting_lora_adapters)}`;
  }

  function drawFigures(frame, usedDrawn) {
    const f = frame.figures || {};
    const number = (value, digits, scale = 1) =>
      value === null || value === undefined ? "–" : (value * scale).toFixed(digits);
    $("figure-tokens-per-s").textContent = number(f.tokens_per_s, 1);
    $("figure-ttft").textContent = number(f.ttft_p50_s, 1, 1000);
    $("figure-itl").textContent = number(f.itl_p50_s, 1, 1000);
    $("figure-kv-usage").textContent = number(f.kv_cache_usage_perc, 1);
    $("figure-preemptions").textContent = number(f.num_preemptions, 0);
    $("figure-prefix-hit-rate").textContent = number(f.prefix_cache_hit_rate, 1, 100);
    $("figure-used-blocks").textContent = usedDrawn;   // counted from the pool drawn
    $("used-blocks-label").textContent = `blocks in use, of ${frame.num_blocks}`;
  }

  // The side panel: the selected request's block table, entry by entry.
  function drawBlockTable(frame) {
    const box = $("block-table"), title = $("bt-title"), list = $("bt-list");
    list.replaceChildren();
    box.toggleAttribute("data-request-id", selected !== null);
    if (selected === null) {
      title.textContent = "Click a request, or a block, to see its block table.";
      title.title = "";
      return;
    }
    box.dataset.requestId = selected;
    title.title = selected;          // the full id; the heading has its label
    const row = frame.running.find((r) => r.request_id === selected);
    const find = (queue) => frame[queue].find((r) => r.request_id === selected);
    if (!row) {
      title.textContent = `${label(selected)}: ` + (
        find("waiting") ? "waiting, no blocks yet." :
        find("preempted") ? "preempted: its blocks were freed, it will be computed again." :
        find("finished") ? `finished (${find("finished").finish_reason}): its blocks were freed.` :
        "not in this step.");
      return;
    }
    const size = frame.block_size;
    const hits = Math.floor(row.num_cached_tokens / size);   // entries found in the prefix cache
    title.textContent = `${label(selected)}: ${row.block_table.length} blocks, ` +
      `${row.num_computed_tokens} tokens computed, ${row.num_cached_tokens} of them found ` +
      "in the prefix cache (★). Striped: shared with another request.";
    list.replaceChildren(...row.block_table.map((b, j) => {
      const held = Math.min(size, Math.max(0, row.num_computed_tokens - j * size));
      const shared = frame.blocks[b] === "s";
      const li = element("li", "", (j < hits ? "★" : "") + b);
      li.dataset.block = b;
      li.style.setProperty("--hue", hue(selected));
      li.style.setProperty("--fill", (100 * held) / size + "%");
      li.toggleAttribute("data-shared", shared);
      li.toggleAttribute("data-hit", j < hits);
      li.toggleAttribute("data-dark", held >= 0.7 * size);
      li.title = `entry ${j}: block ${b}, ${held} of ${size} tokens` +
        (shared ? ", shared" : "") + (j < hits ? ", from the prefix cache" : "");
      return li;
    }));
  }

  // Chapter 09's data-parallel engines: a tab per engine, each its own
  // page (?engine=N, the other parameters kept), this one marked.
  function drawEngineTabs(c) {
    const nav = $("engines"), size = c.data_parallel_size || 1;
    nav.hidden = size < 2;
    nav.replaceChildren();
    for (let rank = 0; rank < size && size > 1; rank++) {
      const query = new URLSearchParams(location.search);
      query.set("engine", rank);
      const tab = element("a", "", `engine ${rank}`);
      tab.href = "?" + query;
      if (rank === c.data_parallel_rank) tab.setAttribute("aria-current", "page");
      nav.append(tab);
    }
  }

  function drawConfig() {
    const c = config;
    drawEngineTabs(c);
    if (c.source === "kv-events") {
      $("engine-config").textContent = `another engine's KV events (vLLM's format) from ${c.endpoint}`;
      return;
    }
    const started = c.started_at && `started ${new Date(c.started_at * 1000).toLocaleTimeString()}`;
    $("engine-config").textContent = [
      c.chapter && `chapter ${c.chapter}`, c.model, c.scheduler,
      `${c.num_blocks} blocks × ${c.block_size} tokens`, `at most ${c.max_num_seqs} requests`,
      `${c.max_num_batched_tokens} tokens a step`,
      `prefix caching ${c.enable_prefix_caching ? "on" : "off"}`,
      c.speculative && "speculative decoding", started,
    ].filter(Boolean).join(" · ");
  }

  function status() {
    if (mode === "live" && connection !== "live") return connection;   // the server first
    if (paused) return "paused";
    if (mode === "replay") return replayEnded ? "ended" : "replay";
    return "live";
  }

  const STATUS_TEXT = {
    live: "● live", reconnecting: "reconnecting…", paused: "❚❚ paused",
    replay: "▶ replay", ended: "ended",
  };

  function drawStatus() {
    const now = status();
    document.body.dataset.mode = mode === "live" && isKv() ? "kv-events" : mode;
    document.body.dataset.status = now;
    $("status").className = now;
    $("status").textContent = STATUS_TEXT[now] +
      (now === "reconnecting" && !frames.length ? " (waiting for the server)" : "") +
      (now === "ended" && mode === "live" ? " (the server refused: check ?key=)" : "");
    $("gaps").textContent = gaps;
    $("pause").textContent = paused || replayEnded ? "Resume" : "Pause";
    $("history").max = Math.max(frames.length - 1, 0);
    $("history").value = currentIndex();
    if (!shown) return;
    $("step-number").textContent = shown.step;
    // Steps count one by one: a kept frame whose step is not the one after
    // the previous kept frame's had frames dropped before it.
    const index = currentIndex(), before = frames[index - 1];
    const missing = before && frames[index] === shown ? shown.step - before.step - 1 : 0;
    $("history-note").textContent = `(${index + 1} of ${frames.length} kept)` +
      (missing > 0 ? ` ⚠ ${missing} frames dropped just before this step` : "");
  }

  // What is drawn now, as one canonical string (the tests compare a live
  // drawing with a replayed one of the same step).
  function summary() {
    if (kvDrawn) return kv.summary();
    const ids = (id) => [...$(id).children].map((li) => li.dataset.requestId).join(",");
    const blocks = blockEls.map((el) =>
      el.className.replace("block ", "") + (el.dataset.owner ? ":" + el.dataset.owner : ""));
    const batch = [...$("batch").children].map((li) => `${li.dataset.requestId}:${li.dataset.kind}`);
    return [`step=${document.body.dataset.step}`, `blocks=${blocks.join(",")}`,
      `waiting=${ids("waiting")}`, `running=${ids("running")}`, `preempted=${ids("preempted")}`,
      `finished=${ids("finished")}`, `batch=${batch.join(",")}`].join("\n");
  }

  // -------------------------------------------------------------- controls
  $("pause").onclick = () => (paused || replayEnded ? resume() : pause());
  $("back").onclick = () => goTo(currentIndex() - 1);
  $("forward").onclick = () => goTo(currentIndex() + 1);
  $("history").oninput = (e) => goTo(Number(e.target.value));
  $("file").onchange = (e) => e.target.files[0] && e.target.files[0].text().then(loadRecording);
  document.addEventListener("keydown", (e) => {     // space, ← and →
    if (e.target.tagName === "INPUT" || (e.target.tagName === "BUTTON" && e.key === " ")) return;
    const button = { " ": "pause", ArrowLeft: "back", ArrowRight: "forward" }[e.key];
    if (button) { e.preventDefault(); $(button).click(); }
  });
  // Clicking a request (a chip, a batch row, a block) shows its block table.
  // In the KV events' prefix cache, clicking a cell picks out its chain.
  document.querySelector("main").addEventListener("click", (e) => {
    const block = e.target.closest("#pool .block");
    const item = e.target.closest("li[data-request-id]");
    if (block && block.dataset.chain) {
      kv.select(Number(block.dataset.chain));
      draw(shown);
    } else if (block && block.dataset.owner) select(block.dataset.owner);
    else if (item) select(item.dataset.requestId);
  });
  $("pool").addEventListener("mouseover", (e) => {
    if (shown && e.target.dataset.block) e.target.title = describeBlock(Number(e.target.dataset.block));
    else if (e.target.dataset.hash) e.target.title = kv.describe(e.target);
  });
  window.addEventListener("resize", () => {
    sizePool();
    if (shown) draw(shown);
  });

  window.liveView = { get frames() { return frames; }, show, pause, resume, summary };

  // ---------------------------------------------------------------- start
  if (params.get("replay")) fetchRecording(params.get("replay"));
  else if (location.protocol !== "file:") connectLive();
  else [mode, replayEnded] = ["replay", true];     // no server: wait for a file
  drawStatus();
  if (mode === "replay" && replayEnded) {
    $("history-note").textContent = "No server here: open a recording (--record-events FILE).";
  }
  setInterval(tick, DRAW_EVERY_MS);
})();
