//! How weir's own plan nodes travel to the workers. datafusion-distributed serializes a
//! plan with datafusion-proto; nodes it does not know go through this codec, registered on
//! the driver's session and on every worker's.
//!
//! The nodes are the sinks' writes on the workers ([`weir_core::sink::WorkerWrite`]s of
//! the kinds the binary lists: Parquet parts, Delta data files), the top-one rule's newest row per key ([`TopOnePerKeyExec`], its keys and
//! order as datafusion-proto's sort expressions), a deduplication's state partitions
//! ([`state_nodes`]: the tag by partition and the deduplication, their settings as JSON)
//! and the sources' scans of a batch's recorded input ([`WorkerScan`]s: the
//! files of `sources/<i>/N`, the Kafka ranges of `offsets/N`), of the kinds the binary
//! lists ([`ScanKind`]). Each goes as its kind's name, the schema it decodes with (as
//! datafusion-proto's message) and its own description as JSON.

use std::sync::Arc;

use datafusion::arrow::datatypes::Schema;
use datafusion::common::{DataFusionError, Result};
use datafusion::execution::TaskContext;
use datafusion::physical_plan::ExecutionPlan;
use datafusion_proto::physical_plan::from_proto::parse_physical_sort_exprs;
use datafusion_proto::physical_plan::to_proto::serialize_physical_sort_exprs;
use datafusion_proto::physical_plan::{
    PhysicalExtensionCodec, PhysicalPlanDecodeContext, PhysicalProtoConverterExtension,
};
use datafusion_proto::protobuf;
use prost::Message;
use weir_core::engine::state_nodes;
use weir_core::engine::top_one::TopOnePerKeyExec;
use weir_core::sink::{PlanNodes, find_write};
use weir_core::source::leaf::find_scan;

/// A weir node on the wire.
#[derive(Clone, PartialEq, prost::Message)]
struct WeirNodeProto {
    /// Which kind of scan ([`ScanKind::kind`]).
    #[prost(string, tag = "1")]
    kind: String,
    /// The schema the node decodes with.
    #[prost(message, optional, tag = "2")]
    schema: Option<protobuf::Schema>,
    /// The node's own description, as JSON.
    #[prost(string, tag = "3")]
    body: String,
    /// The top-one node's keys and order ([`TOP_ONE`]).
    #[prost(message, repeated, tag = "4")]
    keys: Vec<protobuf::PhysicalSortExprNode>,
    #[prost(message, repeated, tag = "5")]
    order: Vec<protobuf::PhysicalSortExprNode>,
}

/// The newest row per key ([`TopOnePerKeyExec`]), run after the shuffle by key.
const TOP_ONE: &str = "weir.TopOnePerKey.v1";

/// The codec for weir's nodes: the scans and writes of `nodes`.
#[derive(Debug, Clone, Copy)]
pub struct WeirCodec {
    nodes: PlanNodes,
}

impl WeirCodec {
    /// A codec for the scans and writes of `nodes`.
    pub fn new(nodes: PlanNodes) -> WeirCodec {
        WeirCodec { nodes }
    }

    fn known(&self) -> String {
        let scans = self.nodes.scans.iter().map(|k| k.kind);
        let names: Vec<&str> = scans
            .chain(self.nodes.writes.iter().map(|k| k.kind))
            .collect();
        names.join(", ")
    }
}

impl PhysicalExtensionCodec for WeirCodec {
    fn try_decode(
        &self,
        buf: &[u8],
        inputs: &[Arc<dyn ExecutionPlan>],
        ctx: &TaskContext,
        proto_converter: &dyn PhysicalProtoConverterExtension,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let node = WeirNodeProto::decode(buf)
            .map_err(|e| DataFusionError::Internal(format!("decoding a weir plan node: {e}")))?;
        if node.kind == TOP_ONE {
            let [input] = inputs else {
                return Err(DataFusionError::Internal(format!(
                    "{TOP_ONE} takes one input, {} given",
                    inputs.len()
                )));
            };
            let schema: Schema = node
                .schema
                .as_ref()
                .ok_or_else(|| DataFusionError::Internal(format!("{TOP_ONE} without a schema")))?
                .try_into()?;
            let decode = PhysicalPlanDecodeContext::new(ctx, self);
            let in_schema = input.schema();
            let keys = parse_physical_sort_exprs(&node.keys, &decode, &in_schema, proto_converter)?;
            let order =
                parse_physical_sort_exprs(&node.order, &decode, &in_schema, proto_converter)?;
            return Ok(Arc::new(TopOnePerKeyExec::new(
                Arc::clone(input),
                keys,
                order,
                Arc::new(schema),
            )));
        }
        if let [input] = inputs {
            let schema = match &node.schema {
                Some(s) => Some(Arc::new(Schema::try_from(s)?)),
                None => None,
            };
            if let Some(state) = state_nodes::decode_node(&node.kind, input, &node.body, schema)? {
                return Ok(state);
            }
        }
        if let Some(kind) = self.nodes.writes.iter().find(|k| k.kind == node.kind) {
            let [input] = inputs else {
                return Err(DataFusionError::Internal(format!(
                    "{} takes one input, {} given",
                    node.kind,
                    inputs.len()
                )));
            };
            let schema: Schema = node
                .schema
                .as_ref()
                .ok_or_else(|| {
                    DataFusionError::Internal(format!("{} without a schema", node.kind))
                })?
                .try_into()?;
            return (kind.decode)(Arc::clone(input), Arc::new(schema), &node.body);
        }
        let Some(kind) = self.nodes.scans.iter().find(|k| k.kind == node.kind) else {
            return Err(DataFusionError::NotImplemented(format!(
                "plan node '{}' is not known to this worker (weir {}, knows {}): driver and \
                 workers must run the same weir",
                node.kind,
                crate::VERSION,
                self.known()
            )));
        };
        if !inputs.is_empty() {
            return Err(DataFusionError::Internal(format!(
                "{} has no inputs, {} given",
                node.kind,
                inputs.len()
            )));
        }
        let schema: Schema = node
            .schema
            .as_ref()
            .ok_or_else(|| DataFusionError::Internal(format!("{} without a schema", node.kind)))?
            .try_into()?;
        (kind.decode)(Arc::new(schema), &node.body)
    }

    fn try_encode(
        &self,
        node: Arc<dyn ExecutionPlan>,
        buf: &mut Vec<u8>,
        proto_converter: &dyn PhysicalProtoConverterExtension,
    ) -> Result<()> {
        if let Some(top) = node.downcast_ref::<TopOnePerKeyExec>() {
            let proto = WeirNodeProto {
                kind: TOP_ONE.into(),
                schema: Some(top.schema().as_ref().try_into()?),
                body: String::new(),
                keys: serialize_physical_sort_exprs(top.keys().to_vec(), self, proto_converter)?,
                order: serialize_physical_sort_exprs(top.order().to_vec(), self, proto_converter)?,
            };
            return proto
                .encode(buf)
                .map_err(|e| DataFusionError::Internal(format!("encoding a weir plan node: {e}")));
        }
        if let Some((kind, body)) = state_nodes::encode_node(&node)? {
            let proto = WeirNodeProto {
                kind: kind.into(),
                schema: Some(node.schema().as_ref().try_into()?),
                body,
                keys: Vec::new(),
                order: Vec::new(),
            };
            return proto
                .encode(buf)
                .map_err(|e| DataFusionError::Internal(format!("encoding a weir plan node: {e}")));
        }
        if let Some(write) = find_write(self.nodes.writes, &node) {
            let (schema, body) = write.encode()?;
            let proto = WeirNodeProto {
                kind: write.kind().into(),
                schema: Some(schema.as_ref().try_into()?),
                body,
                keys: Vec::new(),
                order: Vec::new(),
            };
            return proto
                .encode(buf)
                .map_err(|e| DataFusionError::Internal(format!("encoding a weir plan node: {e}")));
        }
        let Some(scan) = find_scan(self.nodes.scans, &node) else {
            return Err(DataFusionError::NotImplemented(format!(
                "{} cannot be sent to a worker: weir's codec knows {TOP_ONE} and {} only",
                node.name(),
                self.known()
            )));
        };
        let (schema, body) = scan.encode()?;
        let proto = WeirNodeProto {
            kind: scan.kind().into(),
            schema: Some(schema.as_ref().try_into()?),
            body,
            keys: Vec::new(),
            order: Vec::new(),
        };
        proto
            .encode(buf)
            .map_err(|e| DataFusionError::Internal(format!("encoding a weir plan node: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use datafusion::arrow::datatypes::{DataType, Field};
    use datafusion::prelude::SessionContext;
    use datafusion_proto::physical_plan::DefaultPhysicalProtoConverter;
    use weir_core::sink::PlanNodes;
    use weir_core::source::file::{FileEntry, FilesScan, RECORDED_FILES, RecordedFilesExec};
    use weir_core::{BadRecordMode, FileFormat};

    use super::*;

    #[test]
    fn a_scan_travels_whole() {
        let dir = tempfile::tempdir().unwrap();
        let url = url::Url::from_directory_path(dir.path().join("in [1] é")).unwrap();
        let scan = FilesScan {
            dir: url.to_string(),
            storage: BTreeMap::new(),
            format: FileFormat::Csv {
                has_header: true,
                delimiter: b';',
            },
            mode: BadRecordMode::Permissive,
            shares: vec![vec![FileEntry {
                path: format!("{url}a%20b.csv"),
                timestamp: 7,
                batch_id: 3,
                size: Some(12),
                etag: None,
            }]],
            partitions: 2,
            projection: Some(vec![1, 0]),
        };
        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, true),
            Field::new("name", DataType::Utf8, true),
        ]));
        let exec = Arc::new(RecordedFilesExec::try_new(scan.clone(), schema.clone()).unwrap());
        let mut buf = Vec::new();
        let conv = DefaultPhysicalProtoConverter {};
        let codec = WeirCodec::new(PlanNodes {
            scans: &[&RECORDED_FILES],
            writes: &[],
        });
        codec.try_encode(exec.clone(), &mut buf, &conv).unwrap();
        let ctx = SessionContext::new();
        let back = codec.try_decode(&buf, &[], &ctx.task_ctx(), &conv).unwrap();
        let back = back.downcast_ref::<RecordedFilesExec>().unwrap();
        assert_eq!(back.scan(), &scan);
        assert_eq!(back.decode_schema(), &schema);
        assert_eq!(back.schema(), exec.schema());

        // Anything else is refused, naming it.
        let other = ctx.read_empty().unwrap();
        let plan = futures::executor::block_on(other.create_physical_plan()).unwrap();
        let e = codec.try_encode(plan, &mut Vec::new(), &conv).unwrap_err();
        assert!(
            e.to_string().contains("and weir.RecordedFiles.v1 only"),
            "{e}"
        );
        // A kind the worker does not know is refused, naming it and the known ones.
        let none = WeirCodec::new(PlanNodes {
            scans: &[],
            writes: &[],
        });
        let e = none
            .try_decode(&buf, &[], &ctx.task_ctx(), &conv)
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("plan node 'weir.RecordedFiles.v1' is not known"),
            "{e}"
        );
    }
}
