//! The runner's call machine in small worlds of models, for the test
//! targets `model` (every interleaving, breadth first) and `dsim` (a seeded
//! random walk over the same successors, replayed bit for bit).
//!
//! Not a part of the public API: hidden, reached only with the `testing`
//! feature, and free to change. `docs/simulation.md` says what the worlds
//! hold and which promises they check.

mod platform;
mod search;
mod store;
mod world;
mod worlds;

pub use platform::{PlatformModel, Refusal};
pub use search::{Counterexample, Explored, Simulated, SplitMix, explore, simulate};
pub use world::{Asked, Budget, Input};
pub use worlds::{WorldSpec, worlds};
