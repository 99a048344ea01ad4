"""Where harness engines write their logs: the variable a quiet parent (a benchmark) sets
to a folder, so each engine's log goes to a file there instead of its console. It
imports nothing, so a benchmark that runs no engine (`kv-verify --device cuda`) needs
neither vLLM nor NIXL."""

LOG_DIR_ENV = "HARNESS_LOG_DIR"
