//! Encryption at rest of the product's text (issue 35): the keys
//! ([`Keys`], [`KeyRing`], [`StoreKey`]) and the envelope a value is
//! stored in.
//!
//! - A sealed value is text: `enc1:KEY_ID:BASE64`, the base64 (standard,
//!   padded) of a random 24-byte nonce followed by the XChaCha20-Poly1305
//!   ciphertext and its tag. The key id names the key that opens it; the
//!   nonce is random per value (24 bytes: no two values of one key meet).
//! - Its associated data binds it to its own place ([`Place`]: table,
//!   column, run, call and row), so a ciphertext copied into another row
//!   or column (another receipt of the same call included) does not open.
//! - A key's bytes are zeroized when dropped, and never shown: `Debug`
//!   prints the key id only.
//!
//! The envelope is built and tested here; the stores seal their columns
//! with it in the next part (until then [`seal`] and [`open`] are
//! called by the tests only).
use std::fmt;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
use zeroize::Zeroizing;

/// How a sealed value begins (the envelope's version).
const PREFIX: &str = "enc1:";
/// The bytes of a key.
const KEY_BYTES: usize = 32;
/// The bytes of a nonce.
const NONCE_BYTES: usize = 24;
/// What the associated data begins with (the envelope's version).
const AAD_TAG: &[u8] = b"toolrunner-sealed-v1";

/// One key of a store: its id (written beside every value it seals) and
/// its 32 bytes (zeroized when dropped, never shown).
#[derive(Clone)]
pub struct StoreKey {
    id: String,
    bytes: Zeroizing<[u8; KEY_BYTES]>,
}

impl fmt::Debug for StoreKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreKey")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl StoreKey {
    /// The key `id` with these 32 bytes.
    ///
    /// # Errors
    /// The id is empty, longer than 64 characters, or has a character
    /// other than ASCII letters, digits, `-`, `_` and `.`.
    pub fn new(id: impl Into<String>, bytes: [u8; KEY_BYTES]) -> Result<StoreKey, KeyError> {
        let id = id.into();
        let fine = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
        if id.is_empty() || id.len() > 64 || !id.chars().all(fine) {
            return Err(KeyError(format!(
                "the key id {id:?} is not one: 1 to 64 ASCII letters, digits, '-', '_' or '.'"
            )));
        }
        Ok(StoreKey {
            id,
            bytes: Zeroizing::new(bytes),
        })
    }

    /// The key's id.
    pub fn id(&self) -> &str {
        &self.id
    }
}

/// A store's keys, as the executor and the operator's tools read and write
/// with them: one current key, which seals every new value, and the
/// others, which still open what they sealed.
pub trait Keys: Send + Sync + 'static {
    /// The key every new value is sealed with.
    fn current(&self) -> &StoreKey;

    /// The key whose id is `id`, if this provider holds it.
    fn get(&self, id: &str) -> Option<&StoreKey>;
}

/// Keys held in memory: the first is current, the others open what they
/// sealed (rotation: a new key goes first, the old ones stay until
/// `toolrunner store rekey` has sealed everything again).
#[derive(Clone)]
pub struct KeyRing {
    keys: Vec<StoreKey>,
}

impl fmt::Debug for KeyRing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ids: Vec<&str> = self.keys.iter().map(StoreKey::id).collect();
        f.debug_struct("KeyRing").field("ids", &ids).finish()
    }
}

/// A key or a key list that cannot be used; the message names what is
/// wrong (a key's id, never its bytes).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct KeyError(String);

/// The environment variable [`KeyRing::from_env`] reads.
pub const KEYS_ENV: &str = "TOOLRUNNER_STORE_KEYS";

impl KeyRing {
    /// The keys given, the first current.
    ///
    /// # Errors
    /// No key, or two with one id.
    pub fn new(keys: Vec<StoreKey>) -> Result<KeyRing, KeyError> {
        if keys.is_empty() {
            return Err(KeyError(
                "no key: give at least one (the first seals every new value)".to_owned(),
            ));
        }
        for (i, k) in keys.iter().enumerate() {
            if keys[..i].iter().any(|other| other.id == k.id) {
                return Err(KeyError(format!(
                    "the key id {:?} is given twice: each key needs an id of its own",
                    k.id
                )));
            }
        }
        Ok(KeyRing { keys })
    }

    /// Keys written as `ID:BASE64[,ID:BASE64…]` (each 32 bytes in standard
    /// base64), the first current: [`KEYS_ENV`]'s form.
    ///
    /// # Errors
    /// An entry is not `ID:BASE64`, its bytes are not base64 or not 32
    /// long, an id is not one, or an id is given twice. The message names
    /// the entry by its id or position, never its bytes.
    pub fn parse(spec: &str) -> Result<KeyRing, KeyError> {
        let mut keys = Vec::new();
        for (n, entry) in spec.split(',').map(str::trim).enumerate() {
            let Some((id, encoded)) = entry.split_once(':') else {
                return Err(KeyError(format!(
                    "key {} of {KEYS_ENV} is not ID:BASE64",
                    n + 1
                )));
            };
            let id = id.trim();
            let bytes = Zeroizing::new(STANDARD.decode(encoded.trim()).map_err(|_| {
                KeyError(format!(
                    "the key {id:?} is not base64 (give 32 random bytes, for example `openssl rand -base64 32`)"
                ))
            })?);
            let bytes: [u8; KEY_BYTES] = bytes.as_slice().try_into().map_err(|_| {
                KeyError(format!(
                    "the key {id:?} is {} bytes long: a key is 32 bytes (`openssl rand -base64 32`)",
                    bytes.len()
                ))
            })?;
            keys.push(StoreKey::new(id, bytes)?);
        }
        KeyRing::new(keys)
    }

    /// The keys of [`KEYS_ENV`], or `None` when it is unset or empty
    /// (encryption off).
    ///
    /// # Errors
    /// It is set and cannot be parsed (see [`parse`](Self::parse)).
    pub fn from_env() -> Result<Option<KeyRing>, KeyError> {
        match std::env::var(KEYS_ENV) {
            Ok(spec) if !spec.trim().is_empty() => KeyRing::parse(&spec).map(Some),
            _ => Ok(None),
        }
    }

    /// The ids of the keys, the current first.
    pub fn ids(&self) -> Vec<&str> {
        self.keys.iter().map(StoreKey::id).collect()
    }
}

impl Keys for KeyRing {
    fn current(&self) -> &StoreKey {
        &self.keys[0]
    }

    fn get(&self, id: &str) -> Option<&StoreKey> {
        self.keys.iter().find(|k| k.id == id)
    }
}

/// Where a sealed value lives: what its associated data binds it to.
#[cfg_attr(not(test), allow(dead_code))] // the stores' next part
#[derive(Debug, Clone, Copy)]
pub(crate) struct Place<'a> {
    /// The table.
    pub(crate) table: &'a str,
    /// The column.
    pub(crate) column: &'a str,
    /// The run.
    pub(crate) run_id: &'a str,
    /// The call.
    pub(crate) call_id: &'a str,
    /// The row within the call (a receipt's id, a timeline row's number;
    /// empty for the call's own row).
    pub(crate) row: &'a str,
}

impl Place<'_> {
    /// The associated data: the version, then each part with its length.
    fn aad(&self) -> Vec<u8> {
        let mut aad = AAD_TAG.to_vec();
        for part in [self.table, self.column, self.run_id, self.call_id, self.row] {
            let len = u32::try_from(part.len()).unwrap_or(u32::MAX);
            aad.extend_from_slice(&len.to_be_bytes());
            aad.extend_from_slice(part.as_bytes());
        }
        aad
    }
}

/// Why a sealed value does not open.
#[cfg_attr(not(test), allow(dead_code))] // the stores' next part
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum SealError {
    /// The key it names is not among the keys given.
    #[error("sealed with key {0}, which is not among the keys given: add it to open the value")]
    MissingKey(String),
    /// The key opened nothing: another key of the same id, or a value
    /// moved from its own place, or changed.
    #[error(
        "the value sealed with key {0} does not open here: the key's bytes differ, or the value was moved from its own row or changed"
    )]
    DoesNotOpen(String),
    /// Not an envelope.
    #[error("a sealed value is malformed: {0}")]
    Malformed(&'static str),
}

#[cfg_attr(not(test), allow(dead_code))] // the stores' next part
/// Whether `stored` is a sealed value (rather than clear text).
pub(crate) fn is_sealed(stored: &str) -> bool {
    stored.starts_with(PREFIX)
}

#[cfg_attr(not(test), allow(dead_code))] // the stores' next part
/// The key id a sealed value names.
pub(crate) fn key_of(stored: &str) -> Option<&str> {
    stored
        .strip_prefix(PREFIX)?
        .split_once(':')
        .map(|(id, _)| id)
}

#[cfg_attr(not(test), allow(dead_code))] // the stores' next part
fn cipher(key: &StoreKey) -> XChaCha20Poly1305 {
    XChaCha20Poly1305::new(&(*key.bytes).into())
}

#[cfg_attr(not(test), allow(dead_code))] // the stores' next part
/// `plaintext` sealed with the current key for `place`.
pub(crate) fn seal(keys: &dyn Keys, place: &Place<'_>, plaintext: &[u8]) -> String {
    let key = keys.current();
    let nonce: [u8; NONCE_BYTES] = rand::random();
    let aad = place.aad();
    let sealed = cipher(key)
        .encrypt(
            &XNonce::from(nonce),
            Payload {
                msg: plaintext,
                aad: &aad,
            },
        )
        // Only a message longer than the cipher's limit (256 GiB) fails.
        .expect("a value within XChaCha20-Poly1305's limit");
    let mut body = Vec::with_capacity(NONCE_BYTES + sealed.len());
    body.extend_from_slice(&nonce);
    body.extend_from_slice(&sealed);
    format!("{PREFIX}{}:{}", key.id, STANDARD.encode(body))
}

#[cfg_attr(not(test), allow(dead_code))] // the stores' next part
/// The plaintext of `stored`, sealed for `place`.
///
/// # Errors
/// [`SealError`]: the key it names is missing, it does not open (another
/// key's bytes, or moved from its place), or it is not an envelope.
pub(crate) fn open(
    keys: &dyn Keys,
    place: &Place<'_>,
    stored: &str,
) -> Result<Zeroizing<Vec<u8>>, SealError> {
    let rest = stored
        .strip_prefix(PREFIX)
        .ok_or(SealError::Malformed("no envelope prefix"))?;
    let (id, encoded) = rest
        .split_once(':')
        .ok_or(SealError::Malformed("no key id"))?;
    let key = keys
        .get(id)
        .ok_or_else(|| SealError::MissingKey(id.to_owned()))?;
    let body = STANDARD
        .decode(encoded)
        .map_err(|_| SealError::Malformed("not base64"))?;
    if body.len() < NONCE_BYTES + 16 {
        return Err(SealError::Malformed("too short"));
    }
    let (nonce, sealed) = body.split_at(NONCE_BYTES);
    let nonce: [u8; NONCE_BYTES] = nonce
        .try_into()
        .map_err(|_| SealError::Malformed("no nonce"))?;
    let aad = place.aad();
    cipher(key)
        .decrypt(
            &XNonce::from(nonce),
            Payload {
                msg: sealed,
                aad: &aad,
            },
        )
        .map(Zeroizing::new)
        .map_err(|_| SealError::DoesNotOpen(id.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ring(spec: &str) -> KeyRing {
        KeyRing::parse(spec).expect("keys")
    }

    const K1: &str = "k1:AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";
    const K2: &str = "k2:ICEiIyQlJicoKSorLC0uLzAxMjM0NTY3ODk6Ozw9Pj8=";

    fn place<'a>(row: &'a str) -> Place<'a> {
        Place {
            table: "receipts",
            column: "body",
            run_id: "run_1",
            call_id: "call_1",
            row,
        }
    }

    #[test]
    fn a_value_opens_in_its_own_place_only() {
        let keys = ring(K1);
        let sealed = seal(&keys, &place("rcp_1"), b"4111 1111 1111 1111");
        assert!(is_sealed(&sealed));
        assert_eq!(key_of(&sealed), Some("k1"));
        assert!(!sealed.contains("4111"));
        let opened = open(&keys, &place("rcp_1"), &sealed).expect("opens");
        assert_eq!(opened.as_slice(), b"4111 1111 1111 1111");
        // Another receipt of the same call, another column, another call.
        assert_eq!(
            open(&keys, &place("rcp_2"), &sealed),
            Err(SealError::DoesNotOpen("k1".into()))
        );
        let other_column = Place {
            column: "arguments",
            ..place("rcp_1")
        };
        assert!(open(&keys, &other_column, &sealed).is_err());
        let other_call = Place {
            call_id: "call_2",
            ..place("rcp_1")
        };
        assert!(open(&keys, &other_call, &sealed).is_err());
        // The same plaintext twice: two nonces, two ciphertexts.
        assert_ne!(sealed, seal(&keys, &place("rcp_1"), b"4111 1111 1111 1111"));
    }

    #[test]
    fn a_missing_or_wrong_key_is_named() {
        let old = ring(K1);
        let sealed = seal(&old, &place(""), b"secret");
        let rotated = ring(&format!("{K2},{K1}"));
        assert_eq!(rotated.current().id(), "k2");
        assert_eq!(
            open(&rotated, &place(""), &sealed)
                .expect("the old key opens it")
                .as_slice(),
            b"secret"
        );
        let missing = open(&ring(K2), &place(""), &sealed).expect_err("k1 is missing");
        assert_eq!(missing, SealError::MissingKey("k1".into()));
        assert!(missing.to_string().contains("key k1"));
        // Another key under the same id.
        let impostor = ring(&K2.replace("k2:", "k1:"));
        let wrong = open(&impostor, &place(""), &sealed).expect_err("other bytes");
        assert_eq!(wrong, SealError::DoesNotOpen("k1".into()));
        assert!(open(&rotated, &place(""), "enc1:k1:!!").is_err());
        assert!(open(&rotated, &place(""), "clear text").is_err());
    }

    #[test]
    fn keys_never_show_their_bytes() {
        let keys = ring(&format!("{K1},{K2}"));
        let shown = format!("{keys:?} {:?}", keys.current());
        assert!(shown.contains("k1") && shown.contains("k2"));
        for secret in [&K1[3..], &K2[3..], "AAECAwQF", "0, 1, 2, 3"] {
            assert!(!shown.contains(secret), "{shown}");
        }
    }

    #[test]
    fn a_bad_key_list_says_what_is_wrong_without_its_bytes() {
        let cases = [
            ("", "not ID:BASE64"),
            ("k1", "not ID:BASE64"),
            ("k1:not base64!", "not base64"),
            ("k1:AAECAwQF", "is 6 bytes long"),
            (&format!("{K1},{K1}"), "given twice"),
            (&K1.replace("k1:", "k 1:"), "is not one"),
        ];
        for (spec, says) in cases {
            let e = KeyRing::parse(spec).expect_err(spec).to_string();
            assert!(e.contains(says), "{spec:?}: {e}");
            assert!(!e.contains("AAECAwQF"), "{e}");
        }
    }
}
