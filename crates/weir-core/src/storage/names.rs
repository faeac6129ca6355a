//! How names are written in URLs and journals, and which names readers skip.

/// Every byte of `name` outside `A-Z a-z 0-9 - . _ ~ [ ] ( ) ! $ & ' * + , ; = : @` as `%XX`
/// (controls, spaces, `%`, `/`, `?`, `#`, non-ASCII included).
pub fn percent_encode(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~[]()!$&'*+,;=:@".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// `%XX` sequences decoded (invalid sequences kept as they are).
pub fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let (Some(h), Some(l)) = (hex(bytes[i + 1]), hex(bytes[i + 2]))
        {
            out.push(h * 16 + l);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// A name that readers of a folder skip: temp files, `.crc` files, `_` files.
pub fn is_hidden(name: &str) -> bool {
    name.starts_with('.') || name.starts_with('_')
}

/// The hidden name a local write of `name` goes through: `.{name}.{uuid}.tmp`.
pub(crate) fn temp_name(name: &str) -> String {
    format!(".{name}.{}.tmp", uuid::Uuid::new_v4().simple())
}

/// The name a [`temp_name`] was made for; `None` for any other name.
pub(crate) fn temp_target(temp: &str) -> Option<&str> {
    let (target, id) = temp
        .strip_prefix('.')?
        .strip_suffix(".tmp")?
        .rsplit_once('.')?;
    (id.len() == 32 && id.bytes().all(|c| c.is_ascii_hexdigit())).then_some(target)
}

/// FNV-1a (64 bits) of `bytes`: the same in every process and version, so it may name
/// files and place data that outlive a process (a key's state partition, the earlier
/// sketches' registers, a dead letter's file name, the Kafka source's record marks).
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}
