//! Config values written as text and parsed once, when the config is read: durations
//! (`30s`) and schemas (`["order_id bigint", ...]`). A bad value is a deserialization error,
//! which the TOML reader reports with its key.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use datafusion::arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::engine::parse_duration;
use crate::error::{Error, Result};

/// A duration written as `500ms`, `30s`, `5m`, `2h`, `7d` or `0`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DurationText(pub Duration);

impl<'de> Deserialize<'de> for DurationText {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        parse_duration("duration", &s)
            .map(DurationText)
            .map_err(|_| {
                serde::de::Error::custom(format!(
                    "'{s}' is not a duration such as 500ms, 30s, 5m, 2h, 7d or 10 minutes"
                ))
            })
    }
}

impl fmt::Display for DurationText {
    /// `30s`, or `250ms` when not whole seconds: what the parser reads back.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = self.0.as_millis();
        if ms.is_multiple_of(1000) {
            write!(f, "{}s", ms / 1000)
        } else {
            write!(f, "{ms}ms")
        }
    }
}

impl Serialize for DurationText {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// A schema written as `["order_id bigint", "status string", ...]`; columns are nullable.
#[derive(Clone, PartialEq)]
pub struct SchemaText {
    text: Vec<String>,
    schema: SchemaRef,
}

impl fmt::Debug for SchemaText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(&self.text).finish()
    }
}

impl SchemaText {
    /// Parses the column list; an error names the entry and says what is wrong.
    pub fn parse(cols: &[String]) -> Result<Self> {
        Ok(SchemaText {
            text: cols.to_vec(),
            schema: parse_schema("source.schema", cols)?,
        })
    }

    /// The schema.
    pub fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }
}

impl<'de> Deserialize<'de> for SchemaText {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let cols = Vec::<String>::deserialize(d)?;
        SchemaText::parse(&cols).map_err(|e| serde::de::Error::custom(e.to_string()))
    }
}

impl Serialize for SchemaText {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        self.text.serialize(s)
    }
}

/// `["order_id bigint", "status string", ...]` into a schema. Columns are nullable. Errors
/// name the entry as `<key>[i]`.
pub fn parse_schema(key: &str, cols: &[String]) -> Result<SchemaRef> {
    if cols.is_empty() {
        return Err(Error::config(key, "no column given"));
    }
    let mut fields: Vec<Field> = Vec::with_capacity(cols.len());
    for (i, c) in cols.iter().enumerate() {
        let mut parts = c.split_whitespace();
        let (Some(name), Some(ty), None) = (parts.next(), parts.next(), parts.next()) else {
            return Err(Error::config(
                format!("{key}[{i}]"),
                format!("'{c}' is not 'name type'"),
            ));
        };
        let dt = match ty.to_ascii_lowercase().as_str() {
            "string" | "utf8" | "text" | "varchar" => DataType::Utf8,
            "bigint" | "long" | "int64" => DataType::Int64,
            "int" | "integer" | "int32" => DataType::Int32,
            "smallint" | "short" | "int16" => DataType::Int16,
            "double" | "float64" => DataType::Float64,
            "float" | "real" | "float32" => DataType::Float32,
            "boolean" | "bool" => DataType::Boolean,
            "date" => DataType::Date32,
            "timestamp" => DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
            "timestamp_ntz" => DataType::Timestamp(TimeUnit::Microsecond, None),
            "binary" => DataType::Binary,
            _ => {
                return Err(Error::config(
                    format!("{key}[{i}]"),
                    format!(
                        "unknown type '{ty}' in '{c}' (use string, bigint, int, smallint, \
                         double, float, boolean, date, timestamp, timestamp_ntz or binary)"
                    ),
                ));
            }
        };
        if fields.iter().any(|f| f.name() == name) {
            return Err(Error::config(
                format!("{key}[{i}]"),
                format!("column '{name}' is given twice"),
            ));
        }
        fields.push(Field::new(name, dt, true));
    }
    Ok(Arc::new(Schema::new(fields)))
}

/// `retry = { attempts = 10, initial = "1s", max = "1m" }` (a pipeline's `[query]`, the
/// Python writer's retry options): each value left out takes
/// [`RetryPolicy::default`](crate::RetryPolicy)'s.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetryConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempts: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initial: Option<DurationText>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max: Option<DurationText>,
}

impl RetryConfig {
    /// The policy, with the defaults where a value was left out.
    pub fn policy(&self) -> crate::RetryPolicy {
        let d = crate::RetryPolicy::default();
        crate::RetryPolicy {
            attempts: self.attempts.unwrap_or(d.attempts),
            initial: self.initial.map_or(d.initial, |t| t.0),
            max: self.max.map_or(d.max, |t| t.0),
        }
    }
}
