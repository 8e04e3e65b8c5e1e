"""The public packages and modules of gradsync, as the API reference documents them: the one list that the docs'
tests, the release check and the generated bad-input sweep (conformance/sweep/generated/) all read."""

PUBLIC = [
    "gradsync",
    "gradsync.comm",
    "gradsync.optim",
    "gradsync.data",
    "gradsync.nn",
    "gradsync.pipelining",
    "gradsync.elastic",
    "gradsync.observe",
    "gradsync.checkpoint",
    "gradsync.integrations",
    "gradsync.integrations.lightning",
    "gradsync.integrations.accelerate",
    "gradsync.testing",
    "gradsync.errors",
    "gradsync.settings",
]
