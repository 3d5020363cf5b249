"""The weight-patch registry's shared half: wire types (also the server's), and its client.

- `wire`: the JSON the registry speaks (manifests, plans, object references) and its constants.
- `errors`: what the client raises.
- `transport`: one run's HTTP plumbing (auth, retries with backoff).
- `download`: parallel ranged downloads with per-piece sha256, resume and a bandwidth cap.
- `publish`: the trainer's writes (patches, snapshots, model files).
- `client`: `RegistryClient`, reads and downloads of one run.
- `sync`: `sync_weights`, the one routine that brings weights to a version (trainer resume,
  worker bootstrap, live sync through hooks).

Nothing is re-exported here, so the server importing `shared.registry.wire` pulls in no client.
"""
