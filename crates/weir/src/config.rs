//! The connectors' configs by kind: `type = "files"`, `type = "delta-merge"`, ... One
//! variant per connector, each holding the connector's own config type. The `weir` binary's
//! pipeline files and the Python package build their sources and sinks from these.

use serde::{Deserialize, Serialize};
use weir_core::connector::{BuildEnv, SinkSpec, SourceSpec};
use weir_core::sink::{ConsoleConfig, ParquetConfig};
use weir_core::source::RateConfig;
use weir_core::source::file::FilesConfig;
use weir_core::{Result, StreamingDataFrame, WeirSession};
use weir_delta::{DeltaAppendConfig, DeltaMergeConfig};
use weir_kafka::KafkaConfig;
use weir_postgres::PostgresUpsertConfig;

/// Deserializes a `type = ...` table into the variant's own config type. serde's derive for
/// an internally tagged enum buffers the table first, which drops the key from an error
/// (`'7x' is not a duration` with no word of `max-file-age`); reading the variant's type from
/// the table keeps it (`in \`max-file-age\``).
macro_rules! deserialize_by_type {
    ($enum:ident { $($tag:literal => $variant:ident),+ $(,)? }) => {
        impl<'de> Deserialize<'de> for $enum {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
                use serde::de::Error as _;
                let mut table = toml::Table::deserialize(d)?;
                let tag = match table.remove("type") {
                    Some(toml::Value::String(t)) => t,
                    Some(other) => {
                        return Err(D::Error::custom(format!(
                            "`type` must be a string, not {other}"
                        )))
                    }
                    None => return Err(D::Error::missing_field("type")),
                };
                let value = toml::Value::Table(table);
                let parsed: std::result::Result<Self, toml::de::Error> = match tag.as_str() {
                    $($tag => value.try_into().map($enum::$variant),)+
                    other => return Err(D::Error::unknown_variant(other, &[$($tag),+])),
                };
                parsed.map_err(|e| D::Error::custom(e.to_string().trim_end()))
            }
        }
    };
}

/// `[source] type = ...`: one variant per source connector.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "type", rename_all = "kebab-case")]
pub enum SourceConfig {
    Files(FilesConfig),
    Kafka(KafkaConfig),
    Rate(RateConfig),
}

impl SourceConfig {
    pub fn spec(&self) -> &dyn SourceSpec {
        match self {
            SourceConfig::Files(c) => c,
            SourceConfig::Kafka(c) => c,
            SourceConfig::Rate(c) => c,
        }
    }

    pub fn spec_mut(&mut self) -> &mut dyn SourceSpec {
        match self {
            SourceConfig::Files(c) => c,
            SourceConfig::Kafka(c) => c,
            SourceConfig::Rate(c) => c,
        }
    }

    /// The source built on `session`, with the read limits its config sets.
    pub async fn load(&self, session: &WeirSession, env: &BuildEnv) -> Result<StreamingDataFrame> {
        let spec = self.spec();
        Ok(session
            .read_stream()
            .source(spec.build(env).await?)
            .load()
            .await?
            .with_read_limit(spec.read_limit()?))
    }
}

deserialize_by_type!(SourceConfig {
    "files" => Files,
    "kafka" => Kafka,
    "rate" => Rate,
});

/// `[[sink]] type = ...`: one variant per sink connector.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "type", rename_all = "kebab-case")]
pub enum SinkConfig {
    Parquet(ParquetConfig),
    Console(ConsoleConfig),
    DeltaAppend(DeltaAppendConfig),
    DeltaMerge(DeltaMergeConfig),
    PostgresUpsert(PostgresUpsertConfig),
}

deserialize_by_type!(SinkConfig {
    "parquet" => Parquet,
    "console" => Console,
    "delta-append" => DeltaAppend,
    "delta-merge" => DeltaMerge,
    "postgres-upsert" => PostgresUpsert,
});

impl SinkConfig {
    pub fn spec(&self) -> &dyn SinkSpec {
        match self {
            SinkConfig::Parquet(c) => c,
            SinkConfig::Console(c) => c,
            SinkConfig::DeltaAppend(c) => c,
            SinkConfig::DeltaMerge(c) => c,
            SinkConfig::PostgresUpsert(c) => c,
        }
    }

    pub fn spec_mut(&mut self) -> &mut dyn SinkSpec {
        match self {
            SinkConfig::Parquet(c) => c,
            SinkConfig::Console(c) => c,
            SinkConfig::DeltaAppend(c) => c,
            SinkConfig::DeltaMerge(c) => c,
            SinkConfig::PostgresUpsert(c) => c,
        }
    }
}
