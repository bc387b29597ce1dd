//! Examples and end-to-end tests for toolrunner live in `examples/` and `tests/`.
