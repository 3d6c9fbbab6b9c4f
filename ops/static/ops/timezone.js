// The admin's display zone: every <time class="accs-when" datetime="…"> (rendered in UTC by
// accs_site.admin_kit.when_html) is shown as "YYYY-MM-DD HH:MM:SS[.mmm] ZONE" in the zone the operator
// chose in the header's picker: UTC, the browser's zone, or any IANA zone; the choice is remembered
// (localStorage "accs.tz"). Sections that refresh themselves are rewritten as they change.
(function () {
  "use strict";
  var KEY = "accs.tz";
  function browserZone() {
    try { return Intl.DateTimeFormat().resolvedOptions().timeZone || "UTC"; } catch (e) { return "UTC"; }
  }
  function chosen() {
    var z = (window.localStorage && localStorage.getItem(KEY)) || "UTC";
    return z === "browser" ? browserZone() : z;
  }
  function valid(zone) {
    try { new Intl.DateTimeFormat("en-GB", {timeZone: zone}); return true; } catch (e) { return false; }
  }
  function format(date, zone, ms) {
    var parts = {};
    new Intl.DateTimeFormat("en-GB", {timeZone: zone, hourCycle: "h23", year: "numeric", month: "2-digit",
      day: "2-digit", hour: "2-digit", minute: "2-digit", second: "2-digit", timeZoneName: "short"})
      .formatToParts(date).forEach(function (p) { parts[p.type] = p.value; });
    var name = zone === "UTC" ? "UTC" : parts.timeZoneName;
    var clock = parts.year + "-" + parts.month + "-" + parts.day + " " + parts.hour + ":" + parts.minute + ":" +
      parts.second + (ms ? "." + String(date.getMilliseconds()).padStart(3, "0") : "");
    return clock + " " + name;
  }
  window.accsFormatTime = function (date, ms) { return format(date, chosen(), ms); };
  function rewrite(root) {
    var zone = chosen();
    if (!valid(zone)) zone = "UTC";
    root.querySelectorAll("time.accs-when[datetime]").forEach(function (el) {
      var date = new Date(el.getAttribute("datetime"));
      if (isNaN(date)) return;
      el.textContent = format(date, zone, el.dataset.ms === "1");
      el.title = zone === "UTC" ? "" : format(date, "UTC", el.dataset.ms === "1");
    });
  }
  function picker() {
    var tools = document.getElementById("user-tools");
    if (!tools || document.getElementById("accs-tz")) return;
    var select = document.createElement("select");
    select.id = "accs-tz";
    select.setAttribute("aria-label", "Show times in");
    var stored = (window.localStorage && localStorage.getItem(KEY)) || "UTC";
    var zones = ["UTC", "browser"];
    try { zones = zones.concat(Intl.supportedValuesOf("timeZone").filter(function (z) { return z !== "UTC"; })); }
    catch (e) { /* an older browser: UTC and its own zone */ }
    if (zones.indexOf(stored) < 0 && valid(stored)) zones.push(stored);
    zones.forEach(function (z) {
      var option = document.createElement("option");
      option.value = z;
      option.textContent = z === "browser" ? "browser (" + browserZone() + ")" : z;
      option.selected = z === stored;
      select.appendChild(option);
    });
    select.addEventListener("change", function () {
      localStorage.setItem(KEY, select.value);
      rewrite(document);
    });
    var label = document.createElement("label");
    label.className = "accs-tz-label";
    label.appendChild(document.createTextNode("Times in "));
    label.appendChild(select);
    tools.appendChild(document.createTextNode(" / "));
    tools.appendChild(label);
  }
  document.addEventListener("DOMContentLoaded", function () {
    picker();
    rewrite(document);
    new MutationObserver(function (changes) {
      changes.forEach(function (c) {
        c.addedNodes.forEach(function (n) { if (n.querySelectorAll) rewrite(n); });
      });
    }).observe(document.body, {childList: true, subtree: true});
  });
})();
