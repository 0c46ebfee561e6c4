// crossbar's dashboard (GET /_crossbar/). No framework, no build step.
//
// Security: every text that comes from a host or a client (model ids, error texts,
// key names, host names) is inserted with textContent, never as HTML. The ops token
// (when crossbar has one) is kept in this tab's sessionStorage and sent as an
// Authorization header with fetch(); it never goes into a URL (EventSource cannot
// send headers, so the event stream is read from a fetch() body).
"use strict";

(function () {
  var TOKEN_KEY = "crossbar-ops-token";
  var STALE_MS = 5000; // no event for this long: the stream is dead, reconnect
  var base = location.pathname.replace(/[^/]*$/, ""); // "/_crossbar/"
  var token = sessionStorage.getItem(TOKEN_KEY) || "";
  var controller = null;
  var running = false;
  var latest = null;
  var cards = new Map();
  var actions = false;

  function $(id) { return document.getElementById(id); }

  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) { e.className = cls; }
    if (text !== undefined && text !== null) { e.textContent = String(text); }
    return e;
  }

  function sleep(ms) { return new Promise(function (resolve) { setTimeout(resolve, ms); }); }

  function authHeaders() { return token ? { "Authorization": "Bearer " + token } : {}; }

  function setConnection(text, live) {
    var c = $("connection");
    c.textContent = text;
    c.className = "connection " + (live ? "live" : "down");
  }

  // -- login ------------------------------------------------------------------------

  function showLogin(message) {
    stop();
    $("board").hidden = true;
    $("logout").hidden = true;
    $("login").hidden = false;
    var error = $("login-error");
    error.textContent = message || "";
    error.hidden = !message;
    setConnection("token needed", false);
    $("token").focus();
  }

  function showBoard() {
    $("login").hidden = true;
    $("board").hidden = false;
    $("logout").hidden = !token;
  }

  function forget(message) {
    token = "";
    sessionStorage.removeItem(TOKEN_KEY);
    showLogin(message);
  }

  $("login-form").addEventListener("submit", function (event) {
    event.preventDefault();
    token = $("token").value.trim();
    $("token").value = "";
    if (token) { sessionStorage.setItem(TOKEN_KEY, token); }
    start();
  });

  $("logout").addEventListener("click", function () { forget(""); });

  // -- the event stream ---------------------------------------------------------------

  function stop() {
    running = false;
    if (controller) { controller.abort(); controller = null; }
  }

  function start() {
    stop();
    running = true;
    run();
  }

  async function run() {
    var retry = 500;
    controller = new AbortController();
    var own = controller;
    while (running && controller === own) {
      var response = null;
      try {
        response = await fetch(base + "events", { headers: authHeaders(), cache: "no-store", signal: own.signal });
      } catch (e) {
        response = null;
      }
      if (!running || controller !== own) { return; }
      if (response && response.status === 401) {
        forget(token ? "Wrong token." : "");
        return;
      }
      if (response && response.ok && response.body) {
        retry = 500;
        await read(response.body, own);
        if (!running || controller !== own) { return; }
      }
      setConnection("reconnecting…", false);
      await sleep(retry);
      retry = Math.min(retry * 2, 4000);
    }
  }

  async function read(body, own) {
    var reader = body.getReader();
    var decoder = new TextDecoder();
    var buffer = "";
    var timer = null;
    function arm() {
      if (timer) { clearTimeout(timer); }
      timer = setTimeout(function () { reader.cancel().catch(function () {}); }, STALE_MS);
    }
    arm();
    try {
      for (;;) {
        var chunk = await reader.read();
        if (chunk.done) { break; }
        arm();
        buffer += decoder.decode(chunk.value, { stream: true });
        var cut;
        while ((cut = buffer.indexOf("\n\n")) >= 0) {
          var block = buffer.slice(0, cut);
          buffer = buffer.slice(cut + 2);
          var data = block.split("\n").filter(function (line) { return line.indexOf("data:") === 0; })
            .map(function (line) { return line.slice(5).replace(/^ /, ""); }).join("\n");
          if (data && controller === own) {
            showBoard();
            setConnection("live", true);
            render(JSON.parse(data));
          }
        }
      }
    } catch (e) {
      // aborted, or the connection dropped: the caller reconnects
    } finally {
      if (timer) { clearTimeout(timer); }
    }
  }

  // -- host actions -------------------------------------------------------------------

  async function act(name, drain, button) {
    button.disabled = true;
    try {
      var response = await fetch(base + "hosts/" + encodeURIComponent(name) + (drain ? "/drain" : "/undrain"),
        { method: "POST", headers: authHeaders(), cache: "no-store" });
      if (response.status === 401) { forget("Wrong token."); return; }
      if (response.ok) {
        var host = latest && latest.hosts.find(function (h) { return h.name === name; });
        if (host) { host.draining = drain; renderHosts(latest); }
      }
    } catch (e) {
      // crossbar unreachable: the stream shows it
    } finally {
      button.disabled = false;
    }
  }

  // -- rendering ----------------------------------------------------------------------

  function list(values) { return values && values.length ? values.join(", ") : "—"; }

  function ms(seconds) {
    if (seconds === null || seconds === undefined) { return "—"; }
    return seconds < 10 ? Math.round(seconds * 1000) + " ms" : seconds.toFixed(1) + " s";
  }

  function num(value, digits) {
    return value === null || value === undefined ? "—" : Number(value).toFixed(digits);
  }

  function hostState(h) {
    if (h.leaving) { return ["leaving", "leaving"]; }
    if (!h.polled) { return ["waiting", "first poll"]; }
    if (!h.healthy) { return ["down", "down"]; }
    if (h.draining) { return ["draining", "draining"]; }
    return ["up", "up"];
  }

  function card(name) {
    var parts = cards.get(name);
    if (parts) { return parts; }
    parts = { root: el("article", "host") };
    parts.root.dataset.host = name;
    var head = el("header");
    parts.name = el("h3", "name", name);
    parts.badge = el("span", "badge");
    head.append(parts.name, parts.badge);
    var facts = el("dl");
    function fact(label, key) {
      facts.append(el("dt", null, label));
      parts[key] = el("dd", key);
      facts.append(parts[key]);
    }
    fact("in flight", "inflight");
    fact("tokens/s, 1 min avg", "tps");
    fact("loaded", "loaded");
    fact("loading", "loading");
    fact("available", "available");
    fact("last error", "last-error");
    parts.error = parts["last-error"];
    parts.button = el("button", "drain");
    parts.button.type = "button";
    parts.button.addEventListener("click", function () {
      act(name, parts.button.dataset.action === "drain", parts.button);
    });
    parts.root.append(head, facts, parts.button);
    cards.set(name, parts);
    return parts;
  }

  function renderHosts(doc) {
    var box = $("hosts");
    var seen = new Set();
    doc.hosts.forEach(function (h) {
      var parts = card(h.name);
      seen.add(h.name);
      var state = hostState(h);
      parts.root.className = "host " + state[0];
      parts.badge.textContent = state[1];
      parts.inflight.textContent = h.inflight + " / " + (h.max_inflight === null ? "∞" : h.max_inflight);
      parts.tps.textContent = num(h.tps, 1);
      parts.loaded.textContent = list(h.loaded);
      parts.loading.textContent = list(h.loading);
      parts.available.textContent = list(h.available);
      parts.error.textContent = h.last_err || "—";
      parts.error.classList.toggle("error", !!h.last_err);
      parts.button.hidden = !doc.actions || h.leaving;
      parts.button.dataset.action = h.draining ? "undrain" : "drain";
      parts.button.textContent = h.draining ? "Undrain" : "Drain";
      if (parts.root.parentNode !== box) { box.append(parts.root); }
    });
    cards.forEach(function (parts, name) {
      if (!seen.has(name)) { parts.root.remove(); cards.delete(name); }
    });
    $("action-note").hidden = doc.actions;
  }

  function renderRoutes(doc) {
    var body = $("routes").tBodies[0];
    var rows = doc.routes.map(function (r) {
      var tr = el("tr");
      tr.dataset.route = r.name;
      [r.name, list(r.hosts), r.queued, ms(r.oldest_wait_s), r.affinity.key, r.affinity.home, r.affinity.spill,
        r.affinity.none, r.cached_share === null ? "—" : Math.round(r.cached_share * 100) + " %"]
        .forEach(function (value) { tr.append(el("td", null, value)); });
      return tr;
    });
    body.replaceChildren.apply(body, rows);
  }

  function move(m) {
    if (!m) { return "—"; }
    var when = new Date(m.at * 1000).toLocaleTimeString();
    return m.model + " (" + m.reason + ", " + when + ")";
  }

  // Where models live: hosts x models; every text is a host's or the config's: textContent only.
  function renderModels(doc) {
    var view = doc.models || { models: [], hosts: [] };
    var table = $("models");
    var head = el("tr");
    ["host", "models max"].concat(view.models).concat(["last load", "last unload"]).forEach(function (label) {
      head.append(el("th", null, label));
    });
    table.tHead.replaceChildren(head);
    var rows = view.hosts.map(function (h) {
      var tr = el("tr");
      tr.dataset.host = h.name;
      tr.append(el("td", null, h.name));
      tr.append(el("td", null, h.router ? (h.models_max === 0 ? "∞" : h.models_max) : "single model"));
      view.models.forEach(function (m) {
        var cell = Object.prototype.hasOwnProperty.call(h.cells, m) ? h.cells[m] : null;
        var td = el("td", cell ? "cell " + cell.state : "cell none", cell ? (cell.state === "available" ? "·" : cell.inflight) : "");
        td.dataset.model = m;
        if (cell) { td.title = m + ": " + cell.state + ", " + cell.inflight + " in flight"; }
        tr.append(td);
      });
      tr.append(el("td", null, move(h.last_load)));
      tr.append(el("td", null, move(h.last_unload)));
      return tr;
    });
    table.tBodies[0].replaceChildren.apply(table.tBodies[0], rows);
    $("models-note").hidden = view.models.length > 0;
  }

  function syncOptions(select, values) {
    var chosen = select.value;
    var have = Array.prototype.map.call(select.options, function (o) { return o.value; });
    values.forEach(function (v) {
      if (v && have.indexOf(v) < 0) {
        var option = el("option", null, v);
        option.value = v;
        select.append(option);
      }
    });
    select.value = chosen;
  }

  function tokens(t) {
    if (!t) { return "—"; }
    function n(v) { return v === null || v === undefined ? "?" : String(Math.round(v)); }
    return n(t.prompt) + "+" + n(t.cached) + "/" + n(t.generated);
  }

  // The model as the client named it and, beside it, the id an alias (or the route's
  // default) made of it: both texts of the client's or the config's, inserted as text.
  function model(e) {
    var td = el("td", "model");
    td.append(el("span", "named", e.model || "—"));
    if (e.resolved) { td.append(" ", el("span", "resolved", "→ " + e.resolved)); }
    td.title = e.resolved ? (e.model || "(none)") + " → " + e.resolved : (e.model || "");
    return td;
  }

  function renderRecent(doc) {
    var routes = doc.routes.map(function (r) { return r.name; });
    var hosts = doc.hosts.map(function (h) { return h.name; });
    doc.recent.forEach(function (e) {
      if (routes.indexOf(e.route) < 0) { routes.push(e.route); }
      if (e.host && hosts.indexOf(e.host) < 0) { hosts.push(e.host); }
    });
    syncOptions($("filter-route"), routes);
    syncOptions($("filter-host"), hosts);
    var route = $("filter-route").value;
    var host = $("filter-host").value;
    var status = $("filter-status").value;
    var shown = doc.recent.filter(function (e) {
      if (route && e.route !== route) { return false; }
      if (host && e.host !== host) { return false; }
      if (status === "err") { return e.status < 200 || e.status >= 300; }
      if (status) { return String(e.status).charAt(0) === status; }
      return true;
    });
    var rows = shown.map(function (e) {
      var tr = el("tr", e.status >= 500 ? "bad" : e.status >= 400 ? "warn" : null);
      var tps = e.tokens && e.tokens.tps !== null && e.tokens.tps !== undefined ? num(e.tokens.tps, 1) : "—";
      [new Date(e.t * 1000).toLocaleTimeString(), e.route, e.key || "—", model(e), e.host || "—", e.status,
        e.ended || "—", e.why || "—", ms(e.ttfb), tokens(e.tokens), tps, ms(e.duration)]
        .forEach(function (value) { tr.append(value instanceof Node ? value : el("td", null, value)); });
      return tr;
    });
    var body = $("recent").tBodies[0];
    body.replaceChildren.apply(body, rows);
    $("recent-count").textContent = shown.length + " of " + doc.recent.length;
  }

  var SVG = "http://www.w3.org/2000/svg";

  function svg(tag, attrs, text) {
    var e = document.createElementNS(SVG, tag);
    Object.keys(attrs).forEach(function (k) { e.setAttribute(k, attrs[k]); });
    if (text !== undefined) { e.textContent = String(text); }
    return e;
  }

  // A "nice" step for at most ``count`` intervals from 0 to ``top``: 1, 2 or 5 times a power of ten.
  function niceStep(top, count) {
    var raw = top / count, power = Math.pow(10, Math.floor(Math.log10(raw)));
    var step = [1, 2, 5, 10].map(function (m) { return m * power; }).find(function (s) { return s >= raw; });
    return step || 10 * power;
  }

  // Series drawn over one another (two hosts with the same figures) stay apart: each has
  // its own colour, dash pattern and marker shape, and is nudged by a pixel.
  var DASHES = ["", "6 3", "2 3", "8 3 2 3"];
  var MARKS = ["circle", "square", "triangle", "diamond"];

  function marker(shape, x, y, cls) {
    var r = 3.2;
    if (shape === "circle") { return svg("circle", { cx: x, cy: y, r: r, "class": cls }); }
    if (shape === "square") { return svg("rect", { x: x - r, y: y - r, width: 2 * r, height: 2 * r, "class": cls }); }
    var pts = shape === "triangle"
      ? [[x, y - r - 0.8], [x + r + 0.8, y + r], [x - r - 0.8, y + r]]
      : [[x, y - r - 1], [x + r + 1, y], [x, y + r + 1], [x - r - 1, y]];
    return svg("polygon", { points: pts.map(function (p) { return p[0].toFixed(1) + "," + p[1].toFixed(1); }).join(" "),
      "class": cls });
  }

  function renderChart(doc) {
    // Drawn at the box's own width: the labels keep their size on a phone and a laptop.
    var W = Math.max(280, Math.round($("chart").clientWidth - 8)), H = 200, L = 44, B = 20, T = 8;
    var names = Object.keys(doc.chart.hosts).sort();
    var peak = 0;
    names.forEach(function (n) { doc.chart.hosts[n].forEach(function (v) { if (v > peak) { peak = v; } }); });
    var step = niceStep(Math.max(peak, 1), 5);  // an empty chart: 0 to 1
    var top = Math.ceil(Math.max(peak, 1) / step) * step;
    var digits = step < 1 ? Math.min(3, Math.ceil(-Math.log10(step))) : 0;
    function y(v) { return H - B - (H - B - T) * v / top; }
    var picture = svg("svg", { viewBox: "0 0 " + W + " " + H, role: "img", "aria-label": "tokens per second per host" });
    for (var tick = 0; tick <= top + step / 2; tick += step) {
      var ty = y(tick).toFixed(1);
      if (tick > 0) { picture.append(svg("line", { x1: L, y1: ty, x2: W, y2: ty, "class": "grid" })); }
      picture.append(svg("text", { x: L - 4, y: (Number(ty) + 4).toFixed(1), "class": "label end tick" },
        tick.toFixed(digits)));
    }
    picture.append(svg("line", { x1: L, y1: H - B, x2: W, y2: H - B, "class": "axis" }));
    picture.append(svg("line", { x1: L, y1: T, x2: L, y2: H - B, "class": "axis" }));
    picture.append(svg("text", { x: L, y: H - 4, "class": "label" }, "−15 min"));
    picture.append(svg("text", { x: W, y: H - 4, "class": "label end" }, "now"));
    var legend = $("legend");
    var items = [];
    names.forEach(function (name, i) {
      var values = doc.chart.hosts[name];
      var span = Math.max(1, values.length - 1);
      var nudge = names.length > 1 ? (i - (names.length - 1) / 2) * 1.5 : 0;
      var cls = "series s" + (i % 8);
      var dash = DASHES[i % DASHES.length], shape = MARKS[i % MARKS.length];
      var xy = values.map(function (v, j) { return [L + (W - L) * j / span, Math.min(H - B, y(v) + nudge)]; });
      var line = svg("polyline", { points: xy.map(function (p) { return p[0].toFixed(1) + "," + p[1].toFixed(1); })
        .join(" "), "class": cls });
      if (dash) { line.setAttribute("stroke-dasharray", dash); }
      line.dataset.host = name;
      picture.append(line);
      // A marker on every point above zero, offset along the line so equal ones stay visible.
      var every = Math.max(1, Math.round(values.length / 30));
      xy.forEach(function (p, j) {
        if (values[j] > 0 && (j + i) % every === 0) { picture.append(marker(shape, p[0], p[1], "mark " + cls)); }
      });
      var item = el("li");
      var key = svg("svg", { width: 34, height: 12, viewBox: "0 0 34 12", "class": "key" });
      var sample = svg("line", { x1: 1, y1: 6, x2: 33, y2: 6, "class": cls });
      if (dash) { sample.setAttribute("stroke-dasharray", dash); }
      key.append(sample, marker(shape, 17, 6, "mark " + cls));
      item.append(key, el("span", null, name));
      items.push(item);
    });
    $("chart").replaceChildren(picture);
    legend.replaceChildren.apply(legend, items);
  }

  function render(doc) {
    latest = doc;
    actions = doc.actions;
    renderHosts(doc);
    renderRoutes(doc);
    renderModels(doc);
    renderRecent(doc);
    renderChart(doc);
    var note = doc.view && doc.view.note;
    $("view-note").hidden = !note;
    $("view-note").textContent = note || "";
  }

  ["filter-route", "filter-host", "filter-status"].forEach(function (id) {
    $(id).addEventListener("change", function () { if (latest) { renderRecent(latest); } });
  });

  // With an ops.token the page says so (data-login): ask for it before any request.
  if (document.body.dataset.login === "required" && !token) {
    showLogin("");
  } else {
    start();
  }
}());
