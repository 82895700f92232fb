"""Watching the island: Prometheus metrics, a live status page and its JSON, over HTTP.

The scheduler's state is single-threaded: only its loop touches it. So the loop takes a plain-data
`snapshot.Snapshot` of it about once a second (`Observer.refresh`) and publishes it with one reference
assignment; the HTTP thread (`http.ObserveHTTP`) only ever reads the newest published snapshot, never the
state. Prometheus' own metric objects (request latency, heartbeats, resize/recovery durations) are
thread-safe and updated from the loop.

The scheduler does not import this package: whoever starts a scheduler (the daemon, `elasticd scheduler`)
hands it a `serving.Watch`, which it sees only as the small `scheduler.watch.Watcher` interface.
"""
