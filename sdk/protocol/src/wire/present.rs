//! `Option<Value>` that tells an explicit `null` from an absent field.
use serde::{Deserialize, Deserializer};
use serde_json::Value;

/// Use with `#[serde(default, deserialize_with = "present::value")]`: an
/// absent field stays `None`, `null` becomes `Some(Value::Null)`.
pub(crate) fn value<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Value>, D::Error> {
    Value::deserialize(d).map(Some)
}
