/* The live view on another engine's KV events (`--kv-events`, `make
   watch-vllm`): vLLM publishes which block hashes its prefix cache holds
   (common/metrics/kv_events.py), not where they are nor who holds them.
   Each `kv` frame is one batch of events; this file keeps the cache they
   describe and draws one cell per cached hash, in the order stored.

   A chain is one BlockStored event's hashes, and the blocks later stored
   after its last one (the same sequence growing): one colour per chain.
   The cache after a frame is computed from the frame before it; a copy
   is kept every CHECKPOINT_EVERY steps (and at the first kept frame), so
   stepping back recomputes at most that many frames. view.js calls
   makeKvView once and hands it the kept frames. */
"use strict";
function makeKvView(page) {      // page: $, element, sizePool, cellText from view.js
  const CHECKPOINT_EVERY = 25;
  const MAX_EVENTS_LISTED = 12;
  // chain n's colour: n golden angles round the wheel (neighbours differ
  // the most), in one of three shades (chains of close hues differ)
  const chainHue = (chain) => Math.round((222 + (chain - 1) * 137.508) % 360);
  const chainShade = (chain) => 34 + ((chain * 7) % 3) * 8 + "%";
  const number = (n) => n.toLocaleString("en-US");
  const $ = page.$;

  const checkpoints = new WeakMap(); // frame -> the cache after it
  let capacity = 0;                // cells the pool is sized for (it only grows, in a run)
  let selectedChain = null;        // the chain clicked: its cells stand out
  let cells = [];                  // the pool's cell elements, reused

  // ------------------------------------------------------------ the cache
  // A state: `cached` (key -> entry, in the order stored), `tails` (the
  // last hash of each chain that may still grow -> its chain), `chains`
  // (how many so far) and `since` (the first step applied: blocks stored
  // before it are not known here).
  const emptyState = (since) => ({ cached: new Map(), tails: new Map(), chains: 0, since });
  const copyState = (s) =>
    ({ cached: new Map(s.cached), tails: new Map(s.tails), chains: s.chains, since: s.since });
  // vLLM's hashes name blocks in one medium ("GPU"; "CPU" when offloading)
  const keyOf = (hash, medium) => (medium && medium !== "GPU" ? `${medium}:${hash}` : String(hash));

  function apply(state, frame) {   // one frame's events, in order
    for (const event of frame.kv_events || []) {
      if (event.type === "AllBlocksCleared") {
        state.cached.clear();
        state.tails.clear();
      } else if (event.type === "BlockRemoved") {
        for (const hash of event.block_hashes) {
          const key = keyOf(hash, event.medium);
          state.cached.delete(key);
          state.tails.delete(key);
        }
      } else if (event.type === "BlockStored" && event.block_hashes.length) {
        const parent = event.parent_block_hash == null ? null : keyOf(event.parent_block_hash, event.medium);
        let chain = parent === null ? undefined : state.tails.get(parent);
        if (chain === undefined) chain = ++state.chains;   // a new prefix, or a branch
        else state.tails.delete(parent);                   // the chain grows
        event.block_hashes.forEach((hash, index) => {
          const key = keyOf(hash, event.medium);
          state.cached.delete(key);                        // stored again: now the newest
          state.cached.set(key, { key, hash, chain, index, event, step: frame.step });
        });
        state.tails.set(keyOf(event.block_hashes.at(-1), event.medium), chain);
      }
    }
  }

  // The cache after frames[index]: from the nearest checkpoint before it.
  function stateAt(frames, index) {
    let from = index;
    while (from >= 0 && !checkpoints.has(frames[from])) from--;
    const state = from >= 0 ? copyState(checkpoints.get(frames[from])) : emptyState(frames[0].step);
    for (let i = from + 1; i <= index; i++) {
      apply(state, frames[i]);
      if (i === 0 || frames[i].step % CHECKPOINT_EVERY === 0) checkpoints.set(frames[i], copyState(state));
    }
    return state;
  }

  // ------------------------------------------------- the history changes
  function keepFirst(frames) {     // frames[0] is about to go: frames[1] keeps the cache
    if (frames.length > 1 && frames[1].type === "kv" && !checkpoints.has(frames[1])) {
      checkpoints.set(frames[1], stateAt(frames, 1));
    }
  }

  function forgetAfter(frames, index) { // frames[index] came late: later caches change
    for (let i = index; i < frames.length; i++) checkpoints.delete(frames[i]);
  }

  function reset() {               // a new run
    capacity = 0;
    selectedChain = null;
  }

  function select(chain) {
    selectedChain = selectedChain === chain ? null : chain;
  }

  // -------------------------------------------------------------- drawing
  // The cells of frames[index]: the cache before it in its order, the
  // hashes removed by this frame greyed where they were, then the hashes
  // it stored. The first kept frame of a history that began earlier has
  // no "before": its cache as it stands.
  function draw(frames, index) {
    const frame = frames[index];
    const inherited = index === 0 && checkpoints.has(frame) && checkpoints.get(frame).since < frame.step;
    const before = index > 0 ? stateAt(frames, index - 1) : inherited ? null : emptyState(frame.step);
    const after = before ? copyState(before) : copyState(checkpoints.get(frame));
    if (before) apply(after, frame);
    const shown = [];                // [entry, removed]
    if (before) {
      for (const [key, entry] of before.cached) shown.push([entry, after.cached.get(key) !== entry]);
    }
    for (const [key, entry] of after.cached) {
      if (!before || before.cached.get(key) !== entry) shown.push([entry, false]);
    }
    if (shown.length > capacity) {  // room for twice as many: the cells resize seldom
      capacity = Math.max(32, 2 ** Math.ceil(Math.log2(shown.length)));
      page.sizePool(capacity);
    }
    drawCells(shown, frame);
    drawPanel(frame, after);
  }

  // A cell says its chain's number where it fits (the font is a third of the cell).
  function chainText(chain, cell) {
    const room = (cell - 4) / (0.6 * Math.min(16, Math.max(10, cell / 3)));
    return ["#" + chain, String(chain)].find((text) => text.length <= room) || "";
  }

  function drawCells(shown, frame) {
    const pool = $("pool");
    const cell = page.cellText() === "none" ? 0 : parseFloat(pool.style.getPropertyValue("--cell"));
    pool.classList.toggle("selecting", selectedChain !== null);
    while (cells.length < shown.length) {
      const el = document.createElement("div");
      cells.push(el);
    }
    shown.forEach(([entry, removed], i) => {
      const el = cells[i];
      const isNew = !removed && entry.step === frame.step;
      const look = [entry.key, entry.chain, removed, isNew, entry.chain === selectedChain, cell].join("|");
      el.entry = entry;              // for its tooltip
      if (el.drawn === look) return;
      el.drawn = look;
      el.className = "block kv" + (removed ? " removed" : " cached") + (isNew ? " new" : "");
      el.dataset.hash = entry.hash;
      el.dataset.chain = entry.chain;
      el.style.setProperty("--hue", chainHue(entry.chain));
      el.style.setProperty("--shade", chainShade(entry.chain));
      el.toggleAttribute("data-selected", entry.chain === selectedChain);
      el.textContent = cell ? chainText(entry.chain, cell) : "";
    });
    while (pool.children.length > shown.length) pool.lastChild.remove();
    for (let i = pool.children.length; i < shown.length; i++) pool.appendChild(cells[i]);
  }

  function drawPanel(frame, after) {
    const events = frame.kv_events || [];
    const count = (type) => events.filter((e) => e.type === type)
      .reduce((sum, e) => sum + e.block_hashes.length, 0);
    let tokens = 0;
    const chains = new Set();
    for (const entry of after.cached.values()) {
      tokens += entry.event.block_size || 0;
      chains.add(entry.chain);
    }
    const sizes = new Set([...after.cached.values()].map((entry) => entry.event.block_size));
    $("pool-title").textContent = `${number(after.cached.size)} blocks cached` +
      (sizes.size === 1 ? ` × ${[...sizes][0]} tokens` : "") + ", in the order stored";
    $("kv-cached").textContent = number(after.cached.size);
    $("kv-tokens").textContent = number(tokens);
    $("kv-chains").textContent = number(chains.size);
    $("kv-stored").textContent = number(count("BlockStored"));
    $("kv-removed").textContent = number(count("BlockRemoved")) +
      (events.some((e) => e.type === "AllBlocksCleared") ? " + all" : "");
    $("kv-since").textContent = after.since > 1
      ? `Blocks stored before step ${after.since} are not known here (the page joined then): ` +
        "the cache drawn is what it saw stored since." : "";
    // This frame's events, one line each.
    const lines = events.slice(0, MAX_EVENTS_LISTED).map((event) => {
      if (event.type === "AllBlocksCleared") return page.element("li", "cleared", "all blocks cleared");
      const n = event.block_hashes.length, blocks = `${n} block${n === 1 ? "" : "s"}`;
      if (event.type === "BlockRemoved") return page.element("li", "removed", `removed ${blocks}`);
      const entry = after.cached.get(keyOf(event.block_hashes[0], event.medium));
      const parent = event.parent_block_hash == null ? "a new prefix"
        : "after hash …\u2060" + String(event.parent_block_hash).slice(-6);
      const li = page.element("li", "stored", `stored ${blocks} (${number(event.token_ids.length)} ` +
        `tokens)${entry ? `, chain #${entry.chain}` : ""}, ${parent}`);
      if (entry) li.style.setProperty("--hue", chainHue(entry.chain));
      return li;
    });
    if (events.length > MAX_EVENTS_LISTED) {
      lines.push(page.element("li", "", `and ${events.length - MAX_EVENTS_LISTED} more`));
    }
    $("kv-event-list").replaceChildren(...lines);
  }

  function describe(el) {          // a cell's tooltip
    const { hash, chain, index, event, step } = el.entry;
    const size = event.block_size, ids = event.token_ids.slice(index * size, (index + 1) * size);
    return `hash ${hash}\nchain #${chain}, block ${index + 1} of the ${event.block_hashes.length} ` +
      `stored at step ${step}` + (event.medium && event.medium !== "GPU" ? ` (${event.medium})` : "") +
      `\ntokens: ${ids.slice(0, 16).join(" ")}${ids.length > 16 ? " …" : ""}` +
      (el.classList.contains("removed") ? "\nremoved at this step" : "");
  }

  // What is drawn: the step and the cached hashes in order (the tests
  // compare live and replay).
  function summary() {
    const hashes = [...$("pool").children].filter((el) => !el.classList.contains("removed"))
      .map((el) => el.entry.key);
    return [`step=${document.body.dataset.step}`, `cached=${hashes.join(",")}`].join("\n");
  }

  return { draw, summary, describe, select, reset, keepFirst, forgetAfter };
}
