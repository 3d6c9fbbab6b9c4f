// A self-refreshing section: an element with data-live-url gets its inner HTML from that JSON
// endpoint every data-every seconds ({html, generated_at[, status, active]}). The element's
// data-stamp and data-pause name the "Updated …" text and the pause link. An answer with
// "active": false is swapped in one last time and the refresh stops (a job that ended).
(function () {
  function start(live) {
    const stamp = document.getElementById(live.dataset.stamp);
    const toggle = document.getElementById(live.dataset.pause);
    const every = Number(live.dataset.every) * 1000;
    let paused = false;
    toggle.addEventListener("click", function (ev) {
      ev.preventDefault();
      paused = !paused;
      toggle.textContent = paused ? "resume" : "pause";
    });
    async function refresh() {
      if (!paused && !document.hidden) {
        try {
          const response = await fetch(live.dataset.liveUrl, {credentials: "same-origin", headers: {"Accept": "application/json"}});
          if (response.ok) {
            const payload = await response.json();
            if (paused) {
              // Paused while the answer was on its way: the section holds still as the operator asked.
              setTimeout(refresh, every);
              return;
            }
            live.innerHTML = payload.html;
            live.dataset.refreshed = String(Number(live.dataset.refreshed || 0) + 1);
            stamp.textContent = window.accsFormatTime ? window.accsFormatTime(new Date(payload.generated_at), false)
              : new Date(payload.generated_at).toISOString();
            if (payload.status !== undefined) {
              live.dataset.status = payload.status;
            }
            if (payload.active === false) {
              live.dataset.active = "0";
              stamp.textContent += " (" + payload.status + "; refresh stopped)";
              toggle.remove();
              return;
            }
          } else {
            stamp.textContent = "refresh failed (" + response.status + ")";
          }
        } catch (err) {
          stamp.textContent = "refresh failed (" + err + ")";
        }
      }
      setTimeout(refresh, every);
    }
    setTimeout(refresh, every);
  }
  document.querySelectorAll("[data-live-url]").forEach(start);
})();
