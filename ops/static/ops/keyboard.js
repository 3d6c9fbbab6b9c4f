// Keyboard use of the admin: "/" focuses the list's search box (unless one is typing already), and
// a list page's first tab stop is a link that skips to its first row (past the header, the
// breadcrumbs, the filters and the actions).
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
  document.addEventListener("DOMContentLoaded", function () {
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
