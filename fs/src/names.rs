//! Keys as paths: the escaping rule, as pure functions.
//!
//! A key is split on `/` into components (empty ones included); each component becomes one
//! path name, or a short chain of them when it is too long. The rule:
//!
//! 1. **Escape** `%` as `%25` and NUL as `%00` (the kernel cannot hold NUL, and `%` must be
//!    escaped for the rule to be reversible). Every other byte is kept.
//! 2. **Whole-name specials**: the empty component is `%`, `.` is `%2E`, `..` is `%2E%2E`, and a
//!    first component `.kvfs` is `%2Ekvfs` (the mount's own `/.kvfs` directory keeps the name).
//! 3. **Long components** (more than 255 bytes once escaped) are cut, at character boundaries,
//!    into pieces of at most 253 escaped bytes, each followed by `%+` and shown as a directory;
//!    the last piece holds the rest. `find` then shows `prefix%+/rest` for one long name.
//! 4. **Object and directory with one name**: when key `a` and keys under `a/` both exist, the
//!    directory keeps the name `a` and the object is listed as `a%=`. `a%=` always opens the
//!    object `a`.
//!
//! Reverse: join a piece ending in `%+` with the next one without a `/`, drop a final `%=`,
//! and undo the escapes. `%` followed by anything but `25`, `00` or `2E` is not a name of the
//! mount, and only the canonical spelling of a key is accepted (decoding then encoding must give
//! back the same names): `%41` is refused rather than read as `A`, so every key has exactly one
//! path and every path at most one key. Lookups of other names fail with `ENOENT`, creating them
//! with `EINVAL`.
//!
//! The markers `%+` and `%=` cannot occur in an escaped name, since an escaped `%` is always
//! followed by two hex digits.

/// Longest name the kernel holds.
pub const NAME_MAX: usize = 255;
/// Longest escaped piece before the `%+` of a cut long component.
pub const CHUNK_MAX: usize = NAME_MAX - CONTINUE.len();
/// Shortest such piece (the next character, up to 4 bytes, did not fit).
pub const CHUNK_MIN: usize = CHUNK_MAX - 3;
/// Suffix of a piece of a long component that continues in the next path name.
pub const CONTINUE: &str = "%+";
/// Suffix of an object whose name a directory also has.
pub const FILE_MARK: &str = "%=";
/// The mount's own directory at the root.
pub const CONTROL_DIR: &str = ".kvfs";

fn escaped_len(c: char) -> usize {
    match c {
        '%' | '\0' => 3,
        c => c.len_utf8(),
    }
}

/// `%` as `%25`, NUL as `%00`.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '%' => out.push_str("%25"),
            '\0' => out.push_str("%00"),
            c => out.push(c),
        }
    }
    out
}

/// Undoes `%25`, `%00` and `%2E`; any other `%` sequence is not a name of the mount.
pub fn unescape(s: &str) -> Option<String> {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find('%') {
        out.push_str(&rest[..i]);
        let code = rest.get(i + 1..i + 3)?;
        out.push(match code {
            "25" => '%',
            "00" => '\0',
            "2E" => '.',
            _ => return None,
        });
        rest = &rest[i + 3..];
    }
    out.push_str(rest);
    Some(out)
}

/// The path names of one key component: one name, or a chain whose names but the last end in
/// `%+`. `first`: the component is the key's first; `file_mark`: the object shares its name
/// with a directory (rule 4).
pub fn encode_component(c: &str, first: bool, file_mark: bool) -> Vec<String> {
    let mark = if file_mark { FILE_MARK } else { "" };
    let special = match c {
        "" => Some("%"),
        "." => Some("%2E"),
        ".." => Some("%2E%2E"),
        CONTROL_DIR if first => Some("%2Ekvfs"),
        _ => None,
    };
    if let Some(s) = special {
        return vec![format!("{s}{mark}")];
    }
    let mut pieces = Vec::new();
    let mut rest = c;
    loop {
        let len: usize = rest.chars().map(escaped_len).sum();
        if len + mark.len() <= NAME_MAX {
            pieces.push(format!("{}{mark}", escape(rest)));
            return pieces;
        }
        let mut used = 0;
        let mut cut = rest.len();
        for (i, ch) in rest.char_indices() {
            if used + escaped_len(ch) > CHUNK_MAX {
                cut = i;
                break;
            }
            used += escaped_len(ch);
        }
        pieces.push(format!("{}{CONTINUE}", escape(&rest[..cut])));
        rest = &rest[cut..];
    }
}

/// One path name, decoded on its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    /// A piece of a long component; the component continues in the next name.
    Chunk(String),
    /// The end of a component (all of it, unless chunks came before).
    Last { raw: String, file_mark: bool },
}

/// Decodes one path name; `None` when it cannot be a name of the mount.
pub fn decode_piece(name: &[u8]) -> Option<Piece> {
    let s = std::str::from_utf8(name).ok()?;
    if let Some(body) = s.strip_suffix(CONTINUE) {
        let raw = unescape(body)?;
        // Canonical chunks re-escape to themselves and are as long as the rule makes them.
        if raw.is_empty() || escape(&raw) != body || body.len() < CHUNK_MIN {
            return None;
        }
        return Some(Piece::Chunk(raw));
    }
    let (body, file_mark) = match s.strip_suffix(FILE_MARK) {
        Some(b) => (b, true),
        None => (s, false),
    };
    let raw = if body == "%" { String::new() } else { unescape(body)? };
    Some(Piece::Last { raw, file_mark })
}

/// The key component a final name completes, when `chain` + `name` is exactly the encoding
/// of it: `partial` is the raw text of the chunks in `chain`.
pub fn complete_component(
    partial: &str,
    chain: &[String],
    name: &str,
    raw: &str,
    first: bool,
    file_mark: bool,
) -> Option<String> {
    let c = format!("{partial}{raw}");
    let enc = encode_component(&c, first, file_mark);
    let canonical = enc.len() == chain.len() + 1
        && enc[..chain.len()] == *chain
        && enc.last().is_some_and(|l| l == name);
    canonical.then_some(c)
}

/// Where a component shows in a (chunk) directory reached through `chain`: the name there,
/// and whether more names follow (it is then a directory). `None` when it does not show there.
pub fn child_piece(
    component: &str,
    first: bool,
    file_mark: bool,
    chain: &[String],
) -> Option<(String, bool)> {
    let enc = encode_component(component, first, file_mark);
    if enc.len() <= chain.len() || enc[..chain.len()] != *chain {
        return None;
    }
    Some((enc[chain.len()].clone(), enc.len() > chain.len() + 1))
}

/// The path of a key under the mount point (rule 4 not applied), names joined by `/`.
pub fn key_to_path(key: &str) -> String {
    key.split('/')
        .enumerate()
        .flat_map(|(i, c)| encode_component(c, i == 0, false))
        .collect::<Vec<_>>()
        .join("/")
}

/// The key of a path under the mount point, if it is the canonical path of one.
pub fn path_to_key(path: &str) -> Option<String> {
    let mut key = String::new();
    let mut partial = String::new();
    let mut chain: Vec<String> = Vec::new();
    let mut first = true;
    let names: Vec<&str> = path.split('/').collect();
    for (i, name) in names.iter().enumerate() {
        match decode_piece(name.as_bytes())? {
            Piece::Chunk(raw) => {
                partial.push_str(&raw);
                chain.push(name.to_string());
            }
            Piece::Last { raw, file_mark } => {
                if file_mark && i + 1 != names.len() {
                    return None;
                }
                let c = complete_component(&partial, &chain, name, &raw, first, file_mark)?;
                if !first {
                    key.push('/');
                }
                key.push_str(&c);
                first = false;
                partial.clear();
                chain.clear();
            }
        }
    }
    // Keys are never empty (the path "%" spells the empty key, which the store refuses).
    if !chain.is_empty() || key.is_empty() {
        return None;
    }
    Some(key)
}

/// Whether a name is one the kernel can hold.
pub fn kernel_name_ok(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= NAME_MAX
        && name != "."
        && name != ".."
        && !name.contains('/')
        && !name.contains('\0')
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_documented_examples() {
        assert_eq!(key_to_path("model/L0/abc"), "model/L0/abc");
        assert_eq!(key_to_path("a//b"), "a/%/b");
        assert_eq!(key_to_path("/lead"), "%/lead");
        assert_eq!(key_to_path("trail/"), "trail/%");
        assert_eq!(key_to_path("./.."), "%2E/%2E%2E");
        assert_eq!(key_to_path("50%/x\0y"), "50%25/x%00y");
        assert_eq!(key_to_path(".kvfs/status"), "%2Ekvfs/status");
        assert_eq!(key_to_path("d/.kvfs"), "d/.kvfs");
        assert_eq!(key_to_path("..."), "...");
        let long = "x".repeat(600);
        let p = key_to_path(&long);
        let names: Vec<&str> = p.split('/').collect();
        assert_eq!(names.len(), 3);
        assert_eq!(names[0], format!("{}%+", "x".repeat(253)));
        assert_eq!(names[2], "x".repeat(600 - 2 * 253));
        assert_eq!(path_to_key(&p).as_deref(), Some(long.as_str()));
        assert_eq!(encode_component("a", false, true), vec!["a%="]);
        assert_eq!(encode_component("", false, true), vec!["%%="]);
        assert_eq!(path_to_key("a%="), Some("a".into()));
    }

    #[test]
    fn non_canonical_names_are_refused() {
        for bad in ["%41", "%", "a%2Eb", "%2e", "50%", "%zz", ".kvfs/x", "a%=/b", "x%+"] {
            assert_eq!(path_to_key(bad), None, "{bad:?}");
        }
        // A chunk that could have been longer is not canonical.
        let short_chunk = format!("{}%+/{}", "x".repeat(100), "y".repeat(300));
        assert_eq!(path_to_key(&short_chunk), None);
    }

    fn key_strategy() -> impl Strategy<Value = String> {
        let component = prop_oneof![
            4 => "[a-z0-9._%-]{0,12}",
            1 => Just(String::new()),
            1 => Just(".".to_string()),
            1 => Just("..".to_string()),
            1 => Just(".kvfs".to_string()),
            1 => "[%\u{0}é✓a]{0,8}",
            2 => "[a-f0-9%\u{0}é𝄞]{240,270}",
            1 => "[a-z]{500,700}",
        ];
        prop::collection::vec(component, 1..5)
            .prop_map(|cs| cs.join("/"))
            .prop_filter("keys are not empty", |k| !k.is_empty())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn keys_round_trip_through_valid_kernel_names(key in key_strategy()) {
            let path = key_to_path(&key);
            for name in path.split('/') {
                prop_assert!(kernel_name_ok(name), "bad kernel name {name:?} for {key:?}");
            }
            prop_assert_ne!(path.split('/').next(), Some(CONTROL_DIR));
            prop_assert_eq!(path_to_key(&path), Some(key.clone()));
        }

        #[test]
        fn marked_objects_round_trip(key in key_strategy()) {
            let (dir, last) = key.rsplit_once('/').map(|(d, l)| (Some(d), l)).unwrap_or((None, key.as_str()));
            let mut names: Vec<String> = dir.map(|d| key_to_path(d).split('/').map(String::from).collect()).unwrap_or_default();
            names.extend(encode_component(last, dir.is_none(), true));
            for name in &names {
                prop_assert!(kernel_name_ok(name));
            }
            prop_assert_eq!(path_to_key(&names.join("/")), Some(key.clone()));
        }

        #[test]
        fn distinct_keys_have_distinct_paths(a in key_strategy(), b in key_strategy()) {
            prop_assume!(a != b);
            prop_assert_ne!(key_to_path(&a), key_to_path(&b));
        }

        #[test]
        fn decoding_arbitrary_names_never_panics(name in prop::collection::vec(any::<u8>(), 0..300)) {
            let _ = decode_piece(&name);
            if let Ok(s) = std::str::from_utf8(&name)
                && let Some(k) = path_to_key(s).filter(|_| !s.ends_with(FILE_MARK))
            {
                prop_assert_eq!(key_to_path(&k), s);
            }
        }
    }
}
