//! Strict checks of JSON records against the schema, before arrow-json decodes them.
//!
//! arrow-json's tape decoder is lenient: it takes `{"a":1,,}`, `{"a":1}{"a":2}` on one line,
//! a fraction for an integer column (truncated) and a bare number for a timestamp (read in
//! the column's unit). Spark's parser refuses all of these, and FAILFAST must too: each
//! record is first read by serde_json, which checks the syntax, that the record is one JSON
//! object and nothing after it, and that each value of a schema column has a JSON type the
//! column can hold. Nothing is allocated per value.

use std::fmt;

use datafusion::arrow::datatypes::{DataType, Schema};
use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// Checks one record (one JSON object); the error says what is wrong.
pub fn check_record(schema: &Schema, record: &[u8]) -> Result<(), String> {
    let mut de = serde_json::Deserializer::from_slice(record);
    Row { schema }
        .deserialize(&mut de)
        .map_err(|e| e.to_string())?;
    de.end()
        .map_err(|e| format!("more than one JSON value in the record: {e}"))
}

struct Row<'a> {
    schema: &'a Schema,
}

impl<'de> DeserializeSeed<'de> for Row<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Row<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            match self.schema.field_with_name(&key) {
                Ok(f) => map.next_value_seed(Value {
                    dt: f.data_type(),
                    name: &key,
                })?,
                Err(_) => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(())
    }
}

struct Value<'a> {
    dt: &'a DataType,
    name: &'a str,
}

fn integer(dt: &DataType) -> bool {
    matches!(
        dt,
        DataType::Int8
            | DataType::Int16
            | DataType::Int32
            | DataType::Int64
            | DataType::UInt8
            | DataType::UInt16
            | DataType::UInt32
            | DataType::UInt64
    )
}

fn numeric(dt: &DataType) -> bool {
    integer(dt)
        || matches!(
            dt,
            DataType::Float16
                | DataType::Float32
                | DataType::Float64
                | DataType::Decimal128(_, _)
                | DataType::Decimal256(_, _)
        )
}

fn text(dt: &DataType) -> bool {
    matches!(
        dt,
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View
    )
}

impl Value<'_> {
    fn wrong<E: serde::de::Error>(&self, what: &str) -> E {
        E::custom(format!(
            "column '{}' ({}) cannot hold {what}",
            self.name, self.dt
        ))
    }
}

impl<'de> DeserializeSeed<'de> for Value<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Value<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "a value for column '{}'", self.name)
    }
    fn visit_unit<E: serde::de::Error>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_none<E: serde::de::Error>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<(), E> {
        if matches!(self.dt, DataType::Boolean) || text(self.dt) {
            Ok(())
        } else {
            Err(self.wrong("true or false"))
        }
    }
    fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<(), E> {
        if numeric(self.dt) || text(self.dt) {
            Ok(())
        } else {
            Err(self.wrong("a number (timestamps and dates are ISO-8601 strings)"))
        }
    }
    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<(), E> {
        self.visit_i64(v as i64)
    }
    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<(), E> {
        if integer(self.dt) {
            Err(self.wrong(&format!("the fraction {v}")))
        } else if numeric(self.dt) || text(self.dt) {
            Ok(())
        } else {
            Err(self.wrong("a number (timestamps and dates are ISO-8601 strings)"))
        }
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<(), E> {
        // As Spark's JSON reader: a number in quotes is not a number (`"7.25"` in a double
        // column is a bad record), except the spellings of NaN and infinity in float
        // columns; decimals take strings. Strings go to text and temporal columns; one
        // arrow-json cannot parse there fails its decoding, which names the record.
        if integer(self.dt) {
            return Err(self.wrong(&format!(
                "the string \"{v}\" (numbers are written without quotes)"
            )));
        }
        if matches!(
            self.dt,
            DataType::Float16 | DataType::Float32 | DataType::Float64
        ) && !matches!(
            v,
            "NaN" | "Infinity" | "+Infinity" | "-Infinity" | "INF" | "+INF" | "-INF"
        ) {
            return Err(self.wrong(&format!(
                "the string \"{v}\" (numbers are written without quotes; \"NaN\", \
                 \"Infinity\" and \"-Infinity\" are the strings a float takes)"
            )));
        }
        if matches!(
            self.dt,
            DataType::Boolean | DataType::Binary | DataType::LargeBinary
        ) {
            return Err(self.wrong("a string"));
        }
        Ok(())
    }
    fn visit_borrowed_str<E: serde::de::Error>(self, v: &'de str) -> Result<(), E> {
        self.visit_str(v)
    }
    fn visit_string<E: serde::de::Error>(self, v: String) -> Result<(), E> {
        self.visit_str(&v)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        if !matches!(self.dt, DataType::Struct(_) | DataType::Map(_, _)) {
            return Err(self.wrong("an object"));
        }
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        if !matches!(
            self.dt,
            DataType::List(_) | DataType::LargeList(_) | DataType::FixedSizeList(_, _)
        ) {
            return Err(self.wrong("an array"));
        }
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use datafusion::arrow::datatypes::{Field, TimeUnit};

    use super::*;

    #[test]
    fn malformed_records_and_values_of_the_wrong_type_are_refused() {
        let schema = Schema::new(vec![
            Field::new("id", DataType::Int64, true),
            Field::new("name", DataType::Utf8, true),
            Field::new("x", DataType::Float64, true),
            Field::new(
                "at",
                DataType::Timestamp(TimeUnit::Microsecond, Some(Arc::from("UTC"))),
                true,
            ),
        ]);
        for ok in [
            r#"{"id":5,"name":"a","x":1.5,"at":"2026-01-01T00:00:00Z"}"#,
            r#"{"id":null,"extra":{"deep":[1,2]}}"#,
            r#"{"name":5}"#,
            "  {\"id\": 1}  ",
            r#"{"x":"NaN"}"#,
            r#"{"x":"-Infinity"}"#,
        ] {
            assert!(check_record(&schema, ok.as_bytes()).is_ok(), "{ok}");
        }
        for (bad, why) in [
            (r#"{"id":5,"name":"b",,}"#, ""),
            (r#"{"id":5,}"#, ""),
            (r#"{,"id":5}"#, ""),
            (r#"{"id":5 "name":"q"}"#, ""),
            (r#"{"id":5}{"id":6}"#, "more than one JSON value"),
            (r#"{"id":5.7}"#, "fraction"),
            (r#"{"x":"7.25"}"#, "the string \"7.25\""),
            (r#"{"id":"12"}"#, "numbers are written without quotes"),
            (r#"{"at":1767225600}"#, "ISO-8601"),
            (r#"[1,2]"#, ""),
        ] {
            let e = check_record(&schema, bad.as_bytes()).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }
}
