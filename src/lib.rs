//! Examples and end-to-end tests for toolrunner live in `examples/` and
//! `tests/`. The README's code below is compiled as a doctest.
#![doc = include_str!("../README.md")]
