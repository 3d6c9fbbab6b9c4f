// Keyboard use of the admin: "/" focuses the list's search box (unless one is typing already), and
// a list page's first tab stop is a link that skips to its first row (past the header, the
// breadcrumbs, the filters and the actions). From the top of a list to its first row the tab stops
// are few: the list's tools (redrive, export) are one stop and so are the column headers (the arrow
// keys move within each, as in a toolbar), and the search box submits with Enter (its button is
// left to the mouse).
(function () {
  "use strict";
  function typing(el) {
    if (!el) return false;
    var tag = el.tagName;
    return el.isContentEditable || tag === "INPUT" || tag === "TEXTAREA" || tag === "SELECT";
  }
  document.addEventListener("keydown", function (ev) {
    if (ev.key !== "/" || ev.ctrlKey || ev.metaKey || ev.altKey || typing(document.activeElement)) return;
    var search = document.getElementById("searchbar");
    if (!search) return;
    ev.preventDefault();
    search.focus();
    search.select();
  });
  // One tab stop for a row of controls: the one focused last keeps it; Left and Right move within.
  function rove(items, label) {
    if (items.length < 2) return;
    items.forEach(function (el, i) {
      el.tabIndex = i === 0 ? 0 : -1;
      if (label) el.setAttribute("aria-keyshortcuts", "ArrowLeft ArrowRight");
      el.addEventListener("keydown", function (ev) {
        var step = {ArrowRight: 1, ArrowLeft: -1}[ev.key];
        if (!step) return;
        ev.preventDefault();
        var next = items[(items.indexOf(el) + step + items.length) % items.length];
        items.forEach(function (other) { other.tabIndex = -1; });
        next.tabIndex = 0;
        next.focus();
      });
    });
  }
  function fewerStops() {
    if (!document.getElementById("changelist")) return;
    var tools = document.querySelector("#content ul.object-tools");
    if (tools) {
      tools.setAttribute("role", "toolbar");
      tools.setAttribute("aria-label", "List tools (arrow keys move between them)");
      rove(Array.prototype.slice.call(tools.querySelectorAll("a")), true);
    }
    rove(Array.prototype.slice.call(document.querySelectorAll(
      "#result_list thead a, #result_list thead input")), true);
    var submit = document.querySelector("#changelist-search input[type=submit]");
    if (submit && document.getElementById("searchbar")) submit.tabIndex = -1;
  }
  document.addEventListener("DOMContentLoaded", function () {
    fewerStops();
    var first = document.querySelector("#result_list tbody tr a, #result_list tbody tr th a");
    if (!first) return;
    var skip = document.createElement("a");
    skip.id = "accs-skip-rows";
    skip.className = "accs-skip";
    skip.href = "#result_list";
    skip.textContent = "Skip to the first row";
    skip.addEventListener("click", function (ev) { ev.preventDefault(); first.focus(); });
    document.body.insertBefore(skip, document.body.firstChild);
  });
})();
