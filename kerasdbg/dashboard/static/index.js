// kerasdbg's dashboard in TensorBoard: an ES module TensorBoard loads in an
// iframe and whose render() builds the page from the plugin's JSON routes
// (kerasdbg/dashboard/dashboard_plugin.py). No dependency: DOM, SVG, canvas.

const ROUTES = new URL('.', import.meta.url);
const NONFINITE = '#e6007e'; // a NaN/Inf cell or step
const ZERO = '#bdbdbd'; // a zero on a log scale (not recorded: the background, lighter)
const MARKS = {verdict: '#d62728', skipped: '#ff7f0e', rollback: '#1f77b4', nonfinite: NONFINITE};
const WIDTH = 880;
const LABEL = 190;
const ROW = 13;

async function fetchJson(route, query = {}) {
  const url = new URL(route, ROUTES);
  for (const [key, value] of Object.entries(query)) url.searchParams.set(key, value);
  const response = await fetch(url);
  const text = await response.text();
  let body = null;
  try { body = JSON.parse(text); } catch (error) { /* not JSON: an error page */ }
  if (!response.ok || body === null) {
    throw new Error((body && body.error) || `${response.status} ${response.statusText}`);
  }
  return body;
}

function element(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attributes)) {
    if (key === 'style') node.style.cssText = value;
    else node.setAttribute(key, value);
  }
  for (const child of children) {
    node.append(typeof child === 'string' ? document.createTextNode(child) : child);
  }
  return node;
}

function svgElement(tag, attributes = {}) {
  const node = document.createElementNS('http://www.w3.org/2000/svg', tag);
  for (const [key, value] of Object.entries(attributes)) node.setAttribute(key, value);
  return node;
}

const finite = (v) => typeof v === 'number';

// [min, max] of numbers, by a loop (a spread of 100,000 values overflows the call stack);
// null for none.
function extent(values) {
  let lo = Infinity, hi = -Infinity;
  for (const v of values) { if (v < lo) lo = v; if (v > hi) hi = v; }
  return lo <= hi ? [lo, hi] : null;
}

// Viridis, in a few stops, interpolated.
const VIRIDIS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
function colour(t) {
  const x = Math.min(Math.max(t, 0), 1) * (VIRIDIS.length - 1);
  const i = Math.min(Math.floor(x), VIRIDIS.length - 2);
  const f = x - i;
  const c = VIRIDIS[i].map((a, k) => Math.round(a + f * (VIRIDIS[i + 1][k] - a)));
  return `rgb(${c[0]},${c[1]},${c[2]})`;
}

// The marks of a run: {step, kind, label}.
function marksOf(run) {
  const marks = [];
  for (const v of run.verdicts) marks.push({step: v.step, kind: 'verdict', label: v.rule || 'verdict'});
  for (const s of run.skipped) marks.push({step: s, kind: 'skipped', label: 'skipped'});
  for (const s of run.rollbacks) marks.push({step: s, kind: 'rollback', label: 'rollback'});
  if (run.first_nonfinite !== null && run.first_nonfinite !== undefined) {
    const where = run.nan_source ? ` in ${run.nan_source.layer}` : '';
    marks.push({step: run.first_nonfinite, kind: 'nonfinite', label: `first NaN/Inf${where}`});
  }
  return marks;
}

function lineChart(title, line, marks, log) {
  const height = 150;
  const box = element('div', {class: 'chart'});
  box.append(element('div', {class: 'chart-title'}, title + (log ? ' (log scale)' : '')));
  if (!line.steps.length) {
    box.append(element('div', {class: 'none'}, 'not recorded'));
    return box;
  }
  const svg = svgElement('svg', {width: 420, height, class: 'line'});
  const steps = line.steps;
  const lo = steps[0], hi = Math.max(steps[steps.length - 1], lo + 1);
  const shown = line.values.map((v) => (finite(v) && (!log || v > 0) ? (log ? Math.log10(v) : v) : null));
  const range = extent(shown.filter((v) => v !== null));
  if (range === null) {
    box.append(element('div', {class: 'none'}, 'no finite value recorded (NaN/Inf at every step)'));
    return box;
  }
  const [ymin, ymax] = range;
  const x = (s) => 56 + (s - lo) / (hi - lo) * 354;
  const y = (v) => height - 20 - (ymax > ymin ? (v - ymin) / (ymax - ymin) : 0.5) * (height - 35);
  for (const mark of marks) {
    svg.append(svgElement('line', {x1: x(mark.step), x2: x(mark.step), y1: 10, y2: height - 20,
      stroke: MARKS[mark.kind], 'stroke-dasharray': '3,2'}));
  }
  let path = '';
  shown.forEach((v, i) => { if (v !== null) path += `${path ? 'L' : 'M'}${x(steps[i])},${y(v)}`; });
  svg.append(svgElement('path', {d: path, fill: 'none', stroke: '#333', 'stroke-width': 1.5}));
  line.values.forEach((v, i) => {
    if (typeof v === 'string') {
      svg.append(svgElement('circle', {cx: x(steps[i]), cy: 14, r: 3, fill: NONFINITE}));
    }
  });
  const axis = (text, ax, ay, anchor) => {
    const t = svgElement('text', {x: ax, y: ay, 'font-size': 10, 'text-anchor': anchor});
    t.textContent = text;
    svg.append(t);
  };
  axis(String(lo), 56, height - 5, 'start');
  axis(String(steps[steps.length - 1]), 410, height - 5, 'end');
  const label = (v) => (log ? 10 ** v : v).toPrecision(3);
  axis(label(ymax), 52, 16, 'end');
  axis(label(ymin), 52, height - 20, 'end');
  box.append(svg);
  return box;
}

// One canvas of rows x steps; `range` [lo, hi] of the shown values.
// The worse of two cells: NaN/Inf first, then the larger number; null (not recorded) last.
function worse(a, b) {
  if (a === null) return b;
  if (b === null || typeof a === 'string') return a;
  if (typeof b === 'string') return b;
  return b > a ? b : a;
}

// A cell per pixel column at most: the steps that share a column are drawn as their worst
// (a lone NaN/Inf step of thousands stays seen).
function binned(values, columns) {
  if (values.length <= columns) return values;
  const out = new Array(columns).fill(null);
  values.forEach((v, i) => {
    const c = Math.floor(i * columns / values.length);
    out[c] = worse(out[c], v);
  });
  return out;
}

function heatCanvas(rows, steps, map, range, marks) {
  const width = WIDTH - LABEL;
  const canvas = element('canvas', {width, height: Math.max(rows.length, 1) * ROW});
  const g = canvas.getContext('2d');
  const columns = Math.min(steps.length, width);
  const cell = width / Math.max(columns, 1);
  const column = new Map(steps.map((s, i) => [s, Math.floor(i * columns / steps.length)]));
  g.fillStyle = '#f2f2f2';
  g.fillRect(0, 0, canvas.width, canvas.height);
  rows.forEach((values, r) => {
    binned(values, columns).forEach((v, c) => {
      if (v === null) return; // not recorded: blank
      if (typeof v === 'string') g.fillStyle = NONFINITE;
      else if (map.scale === 'log' && v <= 0) g.fillStyle = ZERO; // 0 has no log10
      else {
        const shown = map.scale === 'log' ? Math.log10(v) : v;
        g.fillStyle = range === null ? colour(0.5)
          : colour(range[1] > range[0] ? (shown - range[0]) / (range[1] - range[0]) : 0.5);
      }
      g.fillRect(c * cell, r * ROW, Math.max(cell, 1), ROW - 1);
    });
  });
  for (const mark of marks) {
    const c = column.get(mark.step);
    if (c === undefined) continue;
    g.strokeStyle = MARKS[mark.kind];
    g.setLineDash([3, 2]);
    g.beginPath();
    g.moveTo(c * cell + cell / 2, 0);
    g.lineTo(c * cell + cell / 2, canvas.height);
    g.stroke();
  }
  return canvas;
}

function heatRows(names, rows, steps, map, range, marks) {
  const block = element('div', {class: 'rows'});
  const labels = element('div', {class: 'labels', style: `width:${LABEL}px`});
  for (const name of names) labels.append(element('div', {class: 'label', title: name}, name));
  block.append(labels, heatCanvas(rows, steps, map, range, marks));
  return block;
}

function heatmap(map, marks) {
  const box = element('div', {class: 'heatmap'});
  let range = [0, 1];
  if (map.scale === 'log') {
    const shown = [];
    for (const row of map.values) {
      for (const v of row) if (finite(v) && v > 0) shown.push(Math.log10(v));
    }
    range = extent(shown);
  }
  const nonfinite = map.values.some((row) => row.some((v) => typeof v === 'string'));
  const scale = map.scale !== 'log' ? ' (0 to 1)'
    : range === null ? ' (no finite value above 0)'
      : ` (log10 ${range[0].toFixed(1)} to ${range[1].toFixed(1)}; grey: 0)`;
  box.append(element('div', {class: 'chart-title'},
    `${map.title} per ${map.title.includes('taps') ? 'tap' : 'layer'} and step` + scale +
    (nonfinite ? ' — NaN/Inf cells in magenta' : '') + `, steps ${map.steps[0]}-${map.steps[map.steps.length - 1]}`));
  const many = map.groups.length > 1 && map.rows.length > 24;
  if (!many) {
    box.append(heatRows(map.rows, map.values, map.steps, map, range, marks));
    return box;
  }
  for (const [name, members] of map.groups) {
    // A group's summary row: its worst cell (NaN/Inf first, else the largest).
    const worst = map.steps.map((_, c) => {
      let best = null;
      for (const r of members) {
        const v = map.values[r][c];
        if (typeof v === 'string') return v;
        if (finite(v) && (best === null || v > best)) best = v;
      }
      return best;
    });
    const details = element('details', {class: 'group'});
    const summary = element('summary', {}, `${name} (${members.length})`);
    summary.append(heatCanvas([worst], map.steps, map, range, marks));
    details.append(summary, heatRows(members.map((r) => map.rows[r]),
      members.map((r) => map.values[r]), map.steps, map, range, marks));
    box.append(details);
  }
  return box;
}

function legend() {
  const box = element('div', {class: 'legend'});
  for (const [kind, text] of [['verdict', 'verdict'], ['skipped', 'skipped step'],
    ['rollback', 'rollback'], ['nonfinite', 'first NaN/Inf (and NaN/Inf cells)']]) {
    box.append(element('span', {style: `border-left:12px solid ${MARKS[kind]};padding:0 10px 0 4px`}, text));
  }
  return box;
}

function runSection(run) {
  const section = element('section', {class: 'run', id: `run-${run.run}`});
  section.append(element('h2', {}, run.run));
  const bad = run.first_nonfinite !== null || run.verdicts.length > 0;
  const head = element('div', {class: bad ? 'headline bad' : 'headline'});
  for (const line of run.headline) head.append(element('div', {}, line));
  section.append(head);
  const marks = marksOf(run);
  const charts = element('div', {class: 'charts'});
  charts.append(lineChart('loss', run.loss, marks, false),
    lineChart('global gradient norm', run.global_norm, marks, true));
  section.append(charts);
  for (const map of Object.values(run.heatmaps)) section.append(heatmap(map, marks));
  if (run.verdicts.length) {
    const list = element('ol', {class: 'verdicts'});
    for (const v of run.verdicts.slice(0, 20)) list.append(element('li', {}, `step ${v.step}: ${v.reason}`));
    if (run.verdicts.length > 20) list.append(element('li', {}, `... ${run.verdicts.length - 20} more`));
    section.append(element('div', {class: 'chart-title'}, 'verdicts'), list);
  }
  return section;
}

async function comparison(a, b, out) {
  out.replaceChildren(element('div', {}, 'comparing ...'));
  try {
    const result = await fetchJson('compare', {a, b});
    const d = result.divergence;
    const text = d === null ? `${a} and ${b} agree at every step both recorded`
      : d.kind === 'end' ? `They agree until step ${d.step}: ${d.reason}`
      : `First divergence at step ${d.step}: ${d.tag} ${a}=${d.value_a}, ${b}=${d.value_b} (${d.reason})`;
    const marks = d === null ? [] : [{step: d.step, kind: 'verdict', label: 'divergence'}];
    const charts = element('div', {class: 'charts'});
    charts.append(lineChart(`loss: ${a}`, result.loss[a], marks, false),
      lineChart(`loss: ${b}`, result.loss[b], marks, false));
    out.replaceChildren(element('div', {class: 'headline bad'}, text), charts);
  } catch (error) {
    out.replaceChildren(element('div', {class: 'error'}, `could not compare: ${error.message}`));
  }
}

const STYLE = `
body { font-family: Roboto, sans-serif; font-size: 13px; margin: 16px; color: #212121; }
h1 { font-size: 20px; margin: 0 0 8px; } h2 { font-size: 16px; margin: 18px 0 4px; }
.headline { font-size: 14px; padding: 6px 10px; background: #eef6ee; border-left: 4px solid #2ca02c; }
.headline.bad { background: #fdecee; border-left-color: #d62728; }
.headline div:first-child { font-weight: bold; }
.charts { display: flex; gap: 16px; flex-wrap: wrap; margin: 8px 0; }
.chart-title { font-weight: 500; margin: 10px 0 4px; }
.rows { display: flex; } .labels { font-size: 10px; overflow: hidden; }
.label { height: ${ROW}px; line-height: ${ROW}px; white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
details.group summary { cursor: pointer; display: flex; align-items: center; gap: 6px; }
details.group summary canvas { margin-left: auto; }
.none, .error { color: #757575; } .legend { margin: 6px 0 12px; }
.compare { margin: 8px 0; padding: 8px; background: #f5f5f5; }
`;

export async function render() {
  document.head.append(element('style', {}, STYLE));
  const root = element('div', {});
  document.body.append(root);
  root.append(element('h1', {}, 'kerasdbg'));
  let listing;
  try {
    listing = await fetchJson('runs');
  } catch (error) {
    root.append(element('div', {class: 'error'}, `kerasdbg could not read the runs: ${error.message}`));
    return;
  }
  if (!listing.runs.length) {
    root.append(element('div', {class: 'none'},
      `No run under ${listing.logdir} holds kerasdbg's records: add kerasdbg's callbacks ` +
      '(GradientStatistics(log_dir), StopOnRule(log_dir=...)) to model.fit.'));
    return;
  }
  root.append(legend());
  if (listing.runs.length > 1) {
    const names = listing.runs.map((r) => r.run);
    const pick = (chosen) => {
      const select = element('select', {});
      for (const name of names) {
        const option = element('option', {value: name}, name);
        if (name === chosen) option.selected = true;
        select.append(option);
      }
      return select;
    };
    const a = pick(names[0]), b = pick(names[1]);
    const out = element('div', {});
    const button = element('button', {}, 'compare');
    button.addEventListener('click', () => comparison(a.value, b.value, out));
    root.append(element('div', {class: 'compare'}, 'Two runs side by side: ', a, ' ', b, ' ', button), out);
    comparison(names[0], names[1], out);
  }
  for (const entry of listing.runs) {
    const holder = element('div', {}, `reading ${entry.run} ...`);
    root.append(holder);
    try {
      holder.replaceWith(runSection(await fetchJson('run', {run: entry.run})));
    } catch (error) {
      holder.replaceWith(element('div', {class: 'error'}, `${entry.run}: ${error.message}`));
    }
  }
}
