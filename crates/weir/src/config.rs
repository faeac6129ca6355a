//! The connector registry: every source and sink kind weir ships, in one list each
//! ([`SOURCES`], [`SINKS`]), after Arroyo's `connectors()`. A connector is a config type
//! implementing [`SourceConnector`] or [`SinkConnector`] (the typed side: its `KIND` and its
//! settings); the registry erases it to [`SourceConfig`] or [`SinkConfig`], which pipeline
//! files, `weir chaos`, `weir bench` and the Python package use without naming a kind.
//!
//! Adding a sink: one crate implementing the traits of [`weir_core::connector`], and one
//! line in [`SINKS`]. A source whose reads run on a cluster's workers adds its scan to
//! [`SCANS`].

use std::fmt;
use std::marker::PhantomData;

use serde::{Deserialize, Serialize};
use weir_core::connector::{
    BuildEnv, DurationText, FilesConfig, ParquetConfig, RateConfig, SinkConnector, SinkHarness,
    SinkSpec, SourceConnector, SourceHarness, SourceSpec,
};
use weir_core::sink::{PlanNodes, WriteKind};
use weir_core::source::leaf::ScanKind;
use weir_core::{Result, StreamingDataFrame, WeirSession};
use weir_delta::{DeltaAppendConfig, DeltaMergeConfig};
use weir_kafka::KafkaConfig;
use weir_postgres::PostgresUpsertConfig;

/// Every source kind: `[source] type = ...`.
pub const SOURCES: &[&dyn SourceKind] = &[
    &Kind::<FilesConfig>(PhantomData),
    &Kind::<KafkaConfig>(PhantomData),
    &Kind::<RateConfig>(PhantomData),
];

/// Every sink kind: `[[sink]] type = ...`.
pub const SINKS: &[&dyn SinkKind] = &[
    &Kind::<ParquetConfig>(PhantomData),
    &Kind::<weir_console::ConsoleConfig>(PhantomData),
    &Kind::<DeltaAppendConfig>(PhantomData),
    &Kind::<DeltaMergeConfig>(PhantomData),
    &Kind::<PostgresUpsertConfig>(PhantomData),
];

/// Every scan that runs on a cluster's workers: the reads of the sources whose
/// `reads_on_workers` is true. The driver's codec and every worker's carry these.
pub const SCANS: &[&ScanKind] = &[
    &weir_core::source::file::RECORDED_FILES,
    &weir_kafka::KAFKA_RANGES,
];

/// Every write a sink makes on a cluster's workers (sinks whose `writes_on_workers` is
/// true).
pub const WRITES: &[&WriteKind] = &[
    &weir_core::sink::PARQUET_PARTS,
    &weir_delta::DELTA_FILES,
    &weir_postgres::PG_STAGING,
];

/// The scans and writes the driver's codec and every worker's carry.
pub const NODES: PlanNodes = PlanNodes {
    scans: SCANS,
    writes: WRITES,
};

/// A registry entry: the connector type `C`, erased.
pub struct Kind<C>(PhantomData<fn() -> C>);

/// A sink kind, erased: reads its tables into a [`SinkConfig`].
pub trait SinkKind: Sync {
    fn kind(&self) -> &'static str;
    fn parse(&self, table: toml::Table) -> std::result::Result<SinkConfig, toml::de::Error>;
}

/// A source kind, erased: reads its tables into a [`SourceConfig`].
pub trait SourceKind: Sync {
    fn kind(&self) -> &'static str;
    fn parse(&self, table: toml::Table) -> std::result::Result<SourceConfig, toml::de::Error>;
}

impl<C: SinkConnector> SinkKind for Kind<C> {
    fn kind(&self) -> &'static str {
        C::KIND
    }

    fn parse(&self, table: toml::Table) -> std::result::Result<SinkConfig, toml::de::Error> {
        let config: C = toml::Value::Table(table).try_into()?;
        Ok(SinkConfig(Box::new(config), None))
    }
}

impl<C: SourceConnector> SourceKind for Kind<C> {
    fn kind(&self) -> &'static str {
        C::KIND
    }

    fn parse(&self, table: toml::Table) -> std::result::Result<SourceConfig, toml::de::Error> {
        let config: C = toml::Value::Table(table).try_into()?;
        Ok(SourceConfig(Box::new(config), None))
    }
}

/// A sink connector's config, erased (upcasts to [`SinkSpec`] and [`SinkHarness`]).
trait AnySink: SinkHarness {
    fn kind(&self) -> &'static str;
    fn clone_box(&self) -> Box<dyn AnySink>;
    fn table(&self) -> std::result::Result<toml::Table, toml::ser::Error>;
}

impl<C: SinkConnector> AnySink for C {
    fn kind(&self) -> &'static str {
        C::KIND
    }

    fn clone_box(&self) -> Box<dyn AnySink> {
        Box::new(self.clone())
    }

    fn table(&self) -> std::result::Result<toml::Table, toml::ser::Error> {
        toml::Table::try_from(self)
    }
}

/// A source connector's config, erased (upcasts to [`SourceSpec`] and [`SourceHarness`]).
trait AnySource: SourceHarness {
    fn kind(&self) -> &'static str;
    fn clone_box(&self) -> Box<dyn AnySource>;
    fn table(&self) -> std::result::Result<toml::Table, toml::ser::Error>;
}

impl<C: SourceConnector> AnySource for C {
    fn kind(&self) -> &'static str {
        C::KIND
    }

    fn clone_box(&self) -> Box<dyn AnySource> {
        Box::new(self.clone())
    }

    fn table(&self) -> std::result::Result<toml::Table, toml::ser::Error> {
        toml::Table::try_from(self)
    }
}

/// `[[sink]] type = ...`: a sink kind's config, whichever it is.
/// Its `timeout`, a key every sink takes, is kept beside the connector's own config.
pub struct SinkConfig(Box<dyn AnySink>, Option<DurationText>);

/// `[source] type = ...`: a source kind's config, whichever it is.
pub struct SourceConfig(Box<dyn AnySource>, Option<DurationText>);

/// The accessors and serde impls both erased configs share.
macro_rules! erased_config {
    ($config:ident, $spec:ident, $harness:ident, $registry:ident, $what:literal, $timeout:literal) => {
        impl $config {
            /// The kind, as written in `type = "..."`.
            pub fn kind(&self) -> &'static str {
                self.0.kind()
            }

            /// The connector, as production uses it.
            pub fn spec(&self) -> &dyn $spec {
                &*self.0
            }

            /// The connector, as `weir chaos`, `weir bench` and the tests use it.
            pub fn harness(&self) -> &dyn $harness {
                &*self.0
            }

            /// The connector, to relocate it (chaos and benchmarks).
            pub fn harness_mut(&mut self) -> &mut dyn $harness {
                &mut *self.0
            }

            /// Reads a `type = ...` table through the registry's entry for its type.
            pub fn from_table(mut table: toml::Table) -> std::result::Result<Self, String> {
                let tag = match table.remove("type") {
                    Some(toml::Value::String(t)) => t,
                    Some(other) => return Err(format!("`type` must be a string, not {other}")),
                    None => return Err("missing field `type`".into()),
                };
                // A key of every connector of this kind, read here (left in the table, it is
                // an unknown field of the connector's).
                let timeout = match $timeout.then(|| table.remove("timeout")).flatten() {
                    None => None,
                    Some(v) => Some(
                        DurationText::deserialize(v)
                            .map_err(|e| format!("{} in `timeout`", e.to_string().trim_end()))?,
                    ),
                };
                if timeout.is_some_and(|t| t.0.is_zero()) {
                    return Err(
                        "`timeout` must be more than 0 (every call would be cancelled)".into(),
                    );
                }
                let Some(entry) = $registry.iter().find(|k| k.kind() == tag) else {
                    let known: Vec<_> = $registry
                        .iter()
                        .map(|k| format!("`{}`", k.kind()))
                        .collect();
                    return Err(format!(
                        "unknown {} type `{tag}`, expected one of {}",
                        $what,
                        known.join(", ")
                    ));
                };
                let mut config = entry
                    .parse(table)
                    .map_err(|e| e.to_string().trim_end().to_string())?;
                config.1 = timeout;
                Ok(config)
            }

            /// `timeout`: how long a sink's write, or a source's call, may take before it is
            /// cancelled.
            pub fn timeout(&self) -> Option<std::time::Duration> {
                self.1.map(|t| t.0)
            }
        }

        impl Clone for $config {
            fn clone(&self) -> Self {
                $config(self.0.clone_box(), self.1)
            }
        }

        impl fmt::Debug for $config {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(&*self.0, f)
            }
        }

        /// Written back as its table with `type` first.
        impl Serialize for $config {
            fn serialize<S: serde::Serializer>(
                &self,
                s: S,
            ) -> std::result::Result<S::Ok, S::Error> {
                use serde::ser::Error as _;
                let mut table = toml::Table::new();
                table.insert("type".into(), toml::Value::String(self.kind().into()));
                table.extend(self.0.table().map_err(S::Error::custom)?);
                if let Some(t) = &self.1 {
                    table.insert(
                        "timeout".into(),
                        toml::Value::try_from(t).map_err(S::Error::custom)?,
                    );
                }
                table.serialize(s)
            }
        }

        /// serde's derive for an internally tagged enum buffers the table first, which drops
        /// the key from an error (`'7x' is not a duration` with no word of `max-file-age`);
        /// reading the connector's own type from the table keeps it (`in \`max-file-age\``).
        impl<'de> Deserialize<'de> for $config {
            fn deserialize<D: serde::Deserializer<'de>>(
                d: D,
            ) -> std::result::Result<Self, D::Error> {
                use serde::de::Error as _;
                $config::from_table(toml::Table::deserialize(d)?).map_err(D::Error::custom)
            }
        }
    };
}

erased_config!(SinkConfig, SinkSpec, SinkHarness, SINKS, "sink", true);
erased_config!(
    SourceConfig,
    SourceSpec,
    SourceHarness,
    SOURCES,
    "source",
    true
);

impl SourceConfig {
    /// The source built on `session`, with the read limits its config sets.
    pub async fn load(&self, session: &WeirSession, env: &BuildEnv) -> Result<StreamingDataFrame> {
        let spec = self.spec();
        let mut source = spec.build(env).await?;
        if let Some(after) = self.timeout() {
            source = std::sync::Arc::new(weir_core::source::WithSourceTimeout::new(source, after));
        }
        Ok(session
            .read_stream()
            .source(source)
            .load()
            .await?
            .with_read_limit(spec.read_limit()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_is_listed_once() {
        let mut kinds: Vec<_> = SINKS.iter().map(|k| k.kind()).collect();
        kinds.extend(SOURCES.iter().map(|k| k.kind()));
        let n = kinds.len();
        kinds.sort();
        kinds.dedup();
        assert_eq!(kinds.len(), n, "{kinds:?}");
    }

    #[test]
    fn a_table_reads_back_as_written() {
        let text = r#"type = "delta-merge"
path = "out"
keys = ["id"]
ordering = "ts"
"#;
        let sink: SinkConfig = toml::from_str(text).unwrap();
        assert_eq!(sink.kind(), "delta-merge");
        let again: SinkConfig = toml::from_str(&toml::to_string(&sink).unwrap()).unwrap();
        assert_eq!(format!("{again:?}"), format!("{sink:?}"));
    }

    #[test]
    fn errors_name_the_type_and_the_key() {
        let err = toml::from_str::<SinkConfig>("type = \"nope\"")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("unknown sink type `nope`") && err.contains("`delta-merge`"),
            "{err}"
        );
        let err = toml::from_str::<SourceConfig>(
            "type = \"files\"\npath = \"in\"\nmax-file-age = \"7x\"",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("max-file-age"), "{err}");
    }
}
