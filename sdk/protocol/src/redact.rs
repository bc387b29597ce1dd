//! `Debug` that never shows what a call carries: the arguments, a result,
//! a receipt's body, an error message for the model. A value written with
//! `{:?}` to a log would otherwise put them there; these types show each
//! such field as its size instead (`<redacted: 28 bytes>`). The fields
//! themselves hold everything, unchanged.

use std::fmt;

use serde::Serialize;

/// A payload as `Debug` shows it: its size as compact JSON, never its
/// content (`None` shows as `None`).
pub struct Redacted(Option<usize>);

impl Redacted {
    /// The stand-in for `value` (its compact JSON size).
    pub fn of<T: Serialize + ?Sized>(value: &T) -> Redacted {
        match serde_json::to_vec(value) {
            Ok(bytes) if bytes == b"null" => Redacted(None),
            Ok(bytes) => Redacted(Some(bytes.len())),
            Err(_) => Redacted(Some(0)),
        }
    }
}

impl fmt::Debug for Redacted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(n) => write!(f, "<redacted: {n} bytes>"),
            None => f.write_str("None"),
        }
    }
}

/// Implements `Debug` for a struct, showing `hidden` fields as
/// [`Redacted`]. Every field must be named (a struct pattern checks it), so
/// a field added later is not silently left out.
#[doc(hidden)]
#[macro_export]
macro_rules! debug_without_payloads {
    ($ty:ident { $($shown:ident),* $(,)? } hiding { $($hidden:ident),+ $(,)? }) => {
        impl ::std::fmt::Debug for $ty {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                let $ty { $($shown,)* $($hidden,)+ } = self;
                f.debug_struct(stringify!($ty))
                    $(.field(stringify!($shown), $shown))*
                    $(.field(stringify!($hidden), &$crate::redact::Redacted::of($hidden)))+
                    .finish()
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    struct Call {
        id: String,
        arguments: serde_json::Value,
        note: Option<String>,
    }
    crate::debug_without_payloads!(Call { id } hiding { arguments, note });

    #[test]
    fn hidden_fields_show_their_size_only() {
        let call = Call {
            id: "c1".into(),
            arguments: json!({"card": "4242-SECRET"}),
            note: None,
        };
        let shown = format!("{call:?}");
        assert_eq!(
            shown,
            r#"Call { id: "c1", arguments: <redacted: 22 bytes>, note: None }"#
        );
        assert!(!shown.contains("SECRET"));
    }
}
