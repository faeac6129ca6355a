use datafusion::arrow::datatypes::{Field, Schema};

use super::*;
use crate::source::decode::{BadRecordMode, json_strict};

#[test]
fn same_key_is_byte_equality() {
    let words: Vec<&[u8]> = vec![
        b"",
        b"a",
        b"ab",
        b"order_id",
        b"order_ie",
        b"order_id2",
        b"prder_id2",
        b"updated_at",
        b"updated_au",
        b"\xc3\xbc_twelve_bytes_",
        b"0123456789abcdef",
        b"0123456789abcdeg",
    ];
    for a in &words {
        for b in &words {
            assert_eq!(same_key(a, b), a == b, "{a:?} {b:?}");
        }
    }
}

fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, true),
        Field::new("small", DataType::Int8, true),
        Field::new("u", DataType::UInt32, true),
        Field::new("x", DataType::Float64, true),
        Field::new("f", DataType::Float32, true),
        Field::new("name", DataType::Utf8, true),
        Field::new("ok", DataType::Boolean, true),
        Field::new("d", DataType::Date32, true),
        Field::new(
            "at",
            DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
            true,
        ),
        Field::new("ms", DataType::Timestamp(TimeUnit::Millisecond, None), true),
        Field::new(
            "ns",
            DataType::Timestamp(TimeUnit::Nanosecond, Some("+02:00".into())),
            true,
        ),
    ]))
}

/// A small deterministic generator (xorshift), so a failure names its seed.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn pick<'a>(&mut self, from: &[&'a str]) -> &'a str {
        from[self.below(from.len())]
    }
}

const NUMBERS: &[&str] = &[
    "0",
    "-0",
    "7",
    "-128",
    "127",
    "128",
    "-129",
    "255",
    "4294967295",
    "4294967296",
    "-1",
    "9223372036854775807",
    "9223372036854775808",
    "-9223372036854775808",
    "99999999999999999999",
    "1.5",
    "-2.25",
    "1e3",
    "1E-2",
    "2.5e+10",
    "0.1",
    "3.4e38",
    "3.5e38",
    "1e308",
    "1.7976931348623157e308",
    "1e309",
    "1e400",
    "-1e400",
    "01",
    "-",
    "1.",
    ".5",
    "1e",
    "+1",
    "0x10",
    "1.5.2",
    "--1",
    "123456789012345678901234567890",
];
const STRINGS: &[&str] = &[
    r#""""#,
    r#""a""#,
    r#""héllo ü [1] {x}""#,
    r#""tab\tand\nnewline""#,
    r#""quote\" slash\/ back\\""#,
    r#""\u00e9\u0041""#,
    r#""\ud83d\ude00 smile""#,
    r#""lone \ud800 x""#,
    r#""low \udc00""#,
    r#""bad \x escape""#,
    r#""bad \u12 short""#,
    "\"raw\tcontrol\"",
    r#""unterminated"#,
    r#""2026-01-05""#,
    r#""2026-13-40""#,
    r#""2026-01-05T10:20:30Z""#,
    r#""2026-01-05T10:20:30.123456789+05:30""#,
    r#""2026-01-05 10:20:30""#,
    r#""2026-01-05T10:20:30.5""#,
    r#""not a date""#,
    r#""12""#,
    r#""1.5""#,
    r#""true""#,
    r#""🦀""#,
];
const OTHERS: &[&str] = &[
    "true",
    "false",
    "null",
    "nul",
    "tru",
    "True",
    "NULL",
    "[]",
    "[1,2,3]",
    "{}",
    r#"{"a":{"b":[1,{"c":null}]}}"#,
    "[1,]",
    r#"{"a":1,}"#,
    "[[[[[]]]]]",
    r#"{"a" 1}"#,
];
const KEYS: &[&str] = &[
    "id",
    "small",
    "u",
    "x",
    "f",
    "name",
    "ok",
    "d",
    "at",
    "ms",
    "ns",
    "extra",
    "ID",
    "na\\u006de",
    "",
];

fn value(rng: &mut Rng, key: &str, good: bool) -> String {
    let good_value = match key {
        "id" | "small" | "u" => Some(rng.pick(&["0", "1", "42", "-3", "100"]).to_string()),
        "x" | "f" => Some(rng.pick(&["1.5", "-0.25", "3", "1e2", "0.1"]).to_string()),
        "name" => Some(
            rng.pick(&[r#""a""#, r#""ü x""#, r#""q\"z""#, r#""""#])
                .to_string(),
        ),
        "ok" => Some(rng.pick(&["true", "false"]).to_string()),
        "d" => Some(r#""2026-02-03""#.to_string()),
        "at" | "ms" | "ns" => Some(
            rng.pick(&[
                r#""2026-01-05T10:20:30Z""#,
                r#""2026-01-05T10:20:30.123456+01:00""#,
                r#""2026-01-05 10:20:30""#,
            ])
            .to_string(),
        ),
        _ => None,
    };
    if good
        && rng.below(8) > 0
        && let Some(v) = good_value
    {
        return v;
    }
    if good && rng.below(4) == 0 {
        return "null".into();
    }
    match rng.below(3) {
        0 => rng.pick(NUMBERS).into(),
        1 => rng.pick(STRINGS).into(),
        _ => rng.pick(OTHERS).into(),
    }
}

fn space(rng: &mut Rng) -> &'static str {
    rng.pick(&["", "", "", " ", "\t", "  ", "\r", "\n"])
}

fn record(rng: &mut Rng, good: bool) -> String {
    if !good && rng.below(10) == 0 {
        return rng
            .pick(&[
                "",
                "null",
                "[1]",
                "{",
                "{}{}",
                r#"{"id":1}x"#,
                "\"s\"",
                "{} {}",
            ])
            .into();
    }
    let mut keys: Vec<&str> = Vec::new();
    for _ in 0..rng.below(8) {
        let k = if good {
            rng.pick(&KEYS[..12])
        } else {
            rng.pick(KEYS)
        };
        if !good || !keys.contains(&k) {
            keys.push(k);
        }
    }
    let mut s = format!("{}{{", space(rng));
    for (n, k) in keys.iter().enumerate() {
        if n > 0 {
            s.push(',');
        }
        let v = value(rng, k, good);
        s.push_str(&format!(
            "{}\"{k}\"{}:{}{v}{}",
            space(rng),
            space(rng),
            space(rng),
            space(rng)
        ));
    }
    s.push('}');
    s.push_str(space(rng));
    if !good && rng.below(20) == 0 {
        let mut cut = rng.below(s.len() + 1);
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
    }
    s
}

/// Whatever the one-pass decoder accepts, the checked path accepts too, with the same
/// rows; and it accepts most plain records (else it would be no faster).
#[test]
fn the_one_pass_decoder_agrees_with_the_checked_path() {
    let schema = schema();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let (mut fast, mut strict_ok, mut good_fast, mut good_total) = (0, 0, 0, 0);
    for round in 0..6000 {
        let good = round % 2 == 0;
        let n = 1 + rng.below(4);
        let texts: Vec<String> = (0..n).map(|_| record(&mut rng, good)).collect();
        let mut records: Vec<Option<&[u8]>> = texts.iter().map(|t| Some(t.as_bytes())).collect();
        if rng.below(10) == 0 {
            records.push(None);
        }
        let joined: Vec<u8> = records
            .iter()
            .flat_map(|r| {
                let r = r.unwrap_or(b"{}");
                r.iter().copied().filter(|&c| c != b'\n').chain([b'\n'])
            })
            .collect();
        let strict = json_strict(&schema, &records, &joined, BadRecordMode::FailFast);
        let one_pass = decode(&schema, &records);
        if let Ok(d) = &strict {
            strict_ok += 1;
            assert_eq!(d.malformed(), 0);
        }
        if good && strict.is_ok() {
            good_total += 1;
        }
        if let Some(b) = one_pass {
            fast += 1;
            if good {
                good_fast += 1;
            }
            match &strict {
                Ok(d) => assert_eq!(d.batch, b, "round {round}: {texts:?}"),
                Err(e) => panic!(
                    "round {round}: accepted what the checked path refuses ({e:?}): {texts:?}"
                ),
            }
        }
    }
    assert!(fast > 1000 && strict_ok > fast, "{fast} {strict_ok}");
    assert!(
        good_fast * 10 >= good_total * 8,
        "{good_fast} of {good_total}"
    );
}

#[test]
fn plain_records_decode_in_one_pass_with_escapes_nulls_and_unknown_keys() {
    let schema = schema();
    let texts = [
        r#"{"id":1,"name":"a\"b\u00e9\ud83d\ude00","x":1e2,"ok":true,"at":"2026-01-05T10:20:30Z"}"#,
        r#" { "extra" : {"deep":[1,{"z":null}],"s":"\\"} , "id" : -7 , "name" : null } "#,
        r#"{}"#,
    ];
    let mut records: Vec<Option<&[u8]>> = texts.iter().map(|t| Some(t.as_bytes())).collect();
    records.push(None);
    let b = decode(&schema, &records).unwrap();
    assert_eq!(b.num_rows(), 4);
    let joined = texts.join("\n") + "\n{}\n";
    let strict = json_strict(
        &schema,
        &records,
        joined.as_bytes(),
        BadRecordMode::FailFast,
    )
    .unwrap();
    assert_eq!(strict.batch, b);
    for bad in [
        r#"{"id":1.5}"#,
        r#"{"id":1,"id":2}"#,
        r#"{"id":"1"}"#,
        r#"{"na\u006de":"x"}"#,
        r#"{"id":1}{"id":2}"#,
        r#"{"extra":1e400}"#,
        r#"{"id":1,}"#,
    ] {
        assert!(decode(&schema, &[Some(bad.as_bytes())]).is_none(), "{bad}");
    }
    let nested = Arc::new(Schema::new(vec![Field::new(
        "l",
        DataType::List(Arc::new(Field::new("item", DataType::Int64, true))),
        true,
    )]));
    assert!(decode(&nested, &[Some(br#"{"l":[1]}"#)]).is_none());
}

/// The fast path for `...Z` timestamps gives what arrow's parser gives, in every unit,
/// on valid and invalid dates, times, fractions and near-misses of the form.
#[test]
fn utc_timestamps_parse_as_arrow_parses_them() {
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let tz: Tz = "+02:00".parse().unwrap();
    let units = [
        TimeUnit::Second,
        TimeUnit::Millisecond,
        TimeUnit::Microsecond,
        TimeUnit::Nanosecond,
    ];
    let mut fast = 0;
    for case in 0..200_000 {
        let year = [
            0, 1, 1600, 1677, 1900, 1969, 1970, 2000, 2024, 2100, 2262, 2263, 9999,
        ][next(13) as usize]
            + if case % 3 == 0 { next(400) as u32 } else { 0 };
        let mut text = format!(
            "{:04}-{:02}-{:02}{}{:02}:{:02}:{:02}",
            year.min(9999),
            next(14),
            next(33),
            [" ", "T", "t", "_"][next(4) as usize],
            next(26),
            next(62),
            next(62)
        );
        match next(6) {
            0 => {}
            1 => text.push('.'),
            _ => {
                text.push('.');
                for _ in 0..1 + next(11) {
                    text.push(char::from(b'0' + next(10) as u8));
                }
            }
        }
        text.push_str(["Z", "Z", "Z", "z", "+00:00", "", "Z ", "ZZ"][next(8) as usize]);
        if next(50) == 0 {
            let at = next(text.len() as u64) as usize;
            text.replace_range(at..at + 1, "x");
        }
        for unit in units {
            if utc_instant(text.as_bytes()).is_some() {
                fast += 1;
            }
            let arrow = arrow_instant(&Utc, &text, unit);
            assert_eq!(instant(&Utc, &text, unit), arrow, "{text} {unit:?}");
            if text.ends_with('Z') {
                assert_eq!(
                    instant(&tz, &text, unit),
                    arrow,
                    "{text} {unit:?} in +02:00"
                );
            }
        }
    }
    assert!(fast > 50_000, "only {fast} cases took the fast path");
}
