//! The syntax of JSON, scanned in place: whitespace, strings and their escapes, numbers,
//! literals, and values skipped whole. Every function returns `None` for anything it is not
//! sure of, and the decoder then gives up on the record set.

use super::MAX_DEPTH;

/// `a == b` for short byte strings (column names) without a call to `memcmp`, which cost
/// more than the compare itself: 2.4% of a JSON batch's CPU went to that call.
#[inline]
pub(super) fn same_key(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let word = |s: &[u8]| {
        let mut w = [0u8; 8];
        w.copy_from_slice(s);
        u64::from_ne_bytes(w)
    };
    let (wa, wb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (wa.remainder(), wb.remainder());
    wa.zip(wb).all(|(x, y)| word(x) == word(y)) && ra.iter().zip(rb).all(|(x, y)| x == y)
}

/// The first position at or after `i` that is not JSON whitespace.
pub(super) fn ws(b: &[u8], mut i: usize) -> usize {
    while let Some(b' ' | b'\t' | b'\n' | b'\r') = b.get(i) {
        i += 1;
    }
    i
}

/// The closing quote of the string whose text starts at `i`, and whether it has escapes
/// (checked to be valid). `None` for a raw control character, a bad escape, a lone
/// surrogate or no closing quote.
pub(super) fn string_end(b: &[u8], mut i: usize) -> Option<(usize, bool)> {
    let mut escaped = false;
    loop {
        match *b.get(i)? {
            b'"' => return Some((i, escaped)),
            b'\\' => {
                escaped = true;
                i = escape(b, i + 1)?.1;
            }
            c if c < 0x20 => return None,
            _ => i += 1,
        }
    }
}

/// The character of the escape whose letter is at `i`, and the position after it.
fn escape(b: &[u8], i: usize) -> Option<(char, usize)> {
    let c = match *b.get(i)? {
        b'"' => '"',
        b'\\' => '\\',
        b'/' => '/',
        b'b' => '\u{8}',
        b'f' => '\u{c}',
        b'n' => '\n',
        b'r' => '\r',
        b't' => '\t',
        b'u' => {
            let hi = hex4(b, i + 1)?;
            if (0xD800..0xDC00).contains(&hi) {
                // A high surrogate must be followed by an escaped low one.
                if b.get(i + 5) != Some(&b'\\') || b.get(i + 6) != Some(&b'u') {
                    return None;
                }
                let lo = hex4(b, i + 7)?;
                if !(0xDC00..0xE000).contains(&lo) {
                    return None;
                }
                let c = 0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00);
                return Some((char::from_u32(c)?, i + 11));
            }
            return Some((char::from_u32(hi)?, i + 5));
        }
        _ => return None,
    };
    Some((c, i + 1))
}

fn hex4(b: &[u8], i: usize) -> Option<u32> {
    let digits = std::str::from_utf8(b.get(i..i + 4)?).ok()?;
    if !digits.bytes().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    u32::from_str_radix(digits, 16).ok()
}

/// The text of the string whose opening quote is at `i` (escapes resolved), and the
/// position after its closing quote.
pub(super) fn string(text: &str, i: usize) -> Option<(std::borrow::Cow<'_, str>, usize)> {
    let b = text.as_bytes();
    let (end, escaped) = string_end(b, i + 1)?;
    let raw = text.get(i + 1..end)?;
    if !escaped {
        return Some((raw.into(), end + 1));
    }
    let mut out = String::with_capacity(raw.len());
    let mut j = i + 1;
    while j < end {
        let run = b[j..end]
            .iter()
            .position(|&c| c == b'\\')
            .map_or(end, |p| j + p);
        out.push_str(text.get(j..run)?);
        if run == end {
            break;
        }
        let (c, after) = escape(b, run + 1)?;
        out.push(c);
        j = after;
    }
    Some((out.into(), end + 1))
}

/// The end of the number starting at `i` (strict JSON grammar), and whether it is an
/// integer (no fraction, no exponent).
fn number_end(b: &[u8], mut i: usize) -> Option<(usize, bool)> {
    let digits = |b: &[u8], mut i: usize| {
        let start = i;
        while b.get(i).is_some_and(u8::is_ascii_digit) {
            i += 1;
        }
        (i > start).then_some(i)
    };
    if b.get(i) == Some(&b'-') {
        i += 1;
    }
    match b.get(i)? {
        b'0' => i += 1,
        b'1'..=b'9' => i = digits(b, i)?,
        _ => return None,
    }
    let mut integer = true;
    if b.get(i) == Some(&b'.') {
        integer = false;
        i = digits(b, i + 1)?;
    }
    if let Some(b'e' | b'E') = b.get(i) {
        integer = false;
        i += 1;
        if let Some(b'+' | b'-') = b.get(i) {
            i += 1;
        }
        i = digits(b, i)?;
    }
    Some((i, integer))
}

/// A number serde_json (the checked path's parser) reads without "number out of range":
/// one that is finite as an `f64`.
pub(super) fn in_range(token: &str) -> Option<f64> {
    token
        .parse::<f64>()
        .ok()
        .filter(|v| v.is_finite() && v.abs() < 1.7e308)
}

/// Skips the value at `i` (of a key the schema does not name), checking its syntax.
pub(super) fn skip(b: &[u8], i: usize, depth: usize) -> Option<usize> {
    if depth > MAX_DEPTH {
        return None;
    }
    match *b.get(i)? {
        b'"' => Some(string_end(b, i + 1)?.0 + 1),
        b'{' | b'[' => {
            let (close, object) = if b[i] == b'{' {
                (b'}', true)
            } else {
                (b']', false)
            };
            let mut j = ws(b, i + 1);
            if b.get(j) == Some(&close) {
                return Some(j + 1);
            }
            loop {
                if object {
                    if b.get(j) != Some(&b'"') {
                        return None;
                    }
                    j = ws(b, string_end(b, j + 1)?.0 + 1);
                    if b.get(j) != Some(&b':') {
                        return None;
                    }
                    j = ws(b, j + 1);
                }
                j = ws(b, skip(b, j, depth + 1)?);
                match b.get(j) {
                    Some(b',') => j = ws(b, j + 1),
                    Some(c) if *c == close => return Some(j + 1),
                    _ => return None,
                }
            }
        }
        b't' => literal(b, i, b"true"),
        b'f' => literal(b, i, b"false"),
        b'n' => literal(b, i, b"null"),
        _ => {
            let (end, integer) = number_end(b, i)?;
            let token = std::str::from_utf8(&b[i..end]).ok()?;
            if !(integer && token.len() <= 18) {
                in_range(token)?;
            }
            Some(end)
        }
    }
}

pub(super) fn literal(b: &[u8], i: usize, word: &[u8]) -> Option<usize> {
    (b.get(i..i + word.len()) == Some(word)).then_some(i + word.len())
}

/// The number token at `i` and the position after it.
pub(super) fn number(text: &str, i: usize) -> Option<(usize, &str)> {
    let (end, _) = number_end(text.as_bytes(), i)?;
    Some((end, text.get(i..end)?))
}

/// The integer token at `i` (a fraction or an exponent: `None`, the checked path refuses
/// or judges it; so does `-0`, which serde_json reads as a float) and the position after
/// it.
pub(super) fn integer(text: &str, i: usize) -> Option<(usize, &str)> {
    let (end, integer) = number_end(text.as_bytes(), i)?;
    let token = text.get(i..end)?;
    (integer && token != "-0").then_some((end, token))
}
