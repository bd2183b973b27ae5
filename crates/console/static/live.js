// Keeps a live page current: the server-sent events of the URL in this
// script's data-live attribute replace the element #live.
(function () {
  var script = document.currentScript;
  var box = document.getElementById('live');
  var url = script && script.getAttribute('data-live');
  if (!box || !url || !window.EventSource) return;
  var events = new EventSource(url);
  events.onmessage = function (e) {
    box.innerHTML = e.data;
    box.setAttribute('data-updated', Date.now());
  };
})();
