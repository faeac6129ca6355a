//! How weir's own plan nodes travel to the workers. datafusion-distributed serializes a
//! plan with datafusion-proto; nodes it does not know go through this codec, registered on
//! the driver's session and on every worker's.
//!
//! Today one node: the file source's scan of a batch's recorded files,
//! [`RecordedFilesExec`]. Its description ([`weir_core::source::file::FilesScan`]) goes as
//! JSON, its schema as datafusion-proto's message.

use std::sync::Arc;

use datafusion::arrow::datatypes::Schema;
use datafusion::common::{DataFusionError, Result};
use datafusion::execution::TaskContext;
use datafusion::physical_plan::ExecutionPlan;
use datafusion_proto::physical_plan::{PhysicalExtensionCodec, PhysicalProtoConverterExtension};
use datafusion_proto::protobuf;
use prost::Message;
use weir_core::source::file::{FilesScan, RecordedFilesExec};

/// The kind of a weir node on the wire.
const RECORDED_FILES: &str = "weir.RecordedFiles.v1";

/// A weir node on the wire.
#[derive(Clone, PartialEq, prost::Message)]
struct WeirNodeProto {
    /// Which node (`RECORDED_FILES`).
    #[prost(string, tag = "1")]
    kind: String,
    /// The schema the node decodes with.
    #[prost(message, optional, tag = "2")]
    schema: Option<protobuf::Schema>,
    /// The node's own description, as JSON.
    #[prost(string, tag = "3")]
    body: String,
}

/// The codec for weir's nodes.
#[derive(Debug, Default, Clone, Copy)]
pub struct WeirCodec;

impl PhysicalExtensionCodec for WeirCodec {
    fn try_decode(
        &self,
        buf: &[u8],
        inputs: &[Arc<dyn ExecutionPlan>],
        _ctx: &TaskContext,
        _proto_converter: &dyn PhysicalProtoConverterExtension,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let node = WeirNodeProto::decode(buf)
            .map_err(|e| DataFusionError::Internal(format!("decoding a weir plan node: {e}")))?;
        if node.kind != RECORDED_FILES {
            return Err(DataFusionError::NotImplemented(format!(
                "plan node '{}' is not known to this worker (weir {}): driver and workers must \
                 run the same weir",
                node.kind,
                crate::VERSION
            )));
        }
        if !inputs.is_empty() {
            return Err(DataFusionError::Internal(format!(
                "RecordedFilesExec has no inputs, {} given",
                inputs.len()
            )));
        }
        let schema: Schema = node
            .schema
            .as_ref()
            .ok_or_else(|| DataFusionError::Internal("RecordedFilesExec without a schema".into()))?
            .try_into()?;
        let scan: FilesScan = serde_json::from_str(&node.body).map_err(|e| {
            DataFusionError::Internal(format!("decoding a RecordedFilesExec's scan: {e}"))
        })?;
        Ok(Arc::new(RecordedFilesExec::try_new(
            scan,
            Arc::new(schema),
        )?))
    }

    fn try_encode(
        &self,
        node: Arc<dyn ExecutionPlan>,
        buf: &mut Vec<u8>,
        _proto_converter: &dyn PhysicalProtoConverterExtension,
    ) -> Result<()> {
        let Some(exec) = node.downcast_ref::<RecordedFilesExec>() else {
            return Err(DataFusionError::NotImplemented(format!(
                "{} cannot be sent to a worker: weir's codec knows RecordedFilesExec only",
                node.name()
            )));
        };
        let body = serde_json::to_string(exec.scan()).map_err(|e| {
            DataFusionError::Internal(format!("encoding a RecordedFilesExec's scan: {e}"))
        })?;
        let proto = WeirNodeProto {
            kind: RECORDED_FILES.into(),
            schema: Some(exec.decode_schema().as_ref().try_into()?),
            body,
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
    use weir_core::source::file::FileEntry;
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
        WeirCodec.try_encode(exec.clone(), &mut buf, &conv).unwrap();
        let ctx = SessionContext::new();
        let back = WeirCodec
            .try_decode(&buf, &[], &ctx.task_ctx(), &conv)
            .unwrap();
        let back = back.downcast_ref::<RecordedFilesExec>().unwrap();
        assert_eq!(back.scan(), &scan);
        assert_eq!(back.decode_schema(), &schema);
        assert_eq!(back.schema(), exec.schema());

        // Anything else is refused, naming it.
        let other = ctx.read_empty().unwrap();
        let plan = futures::executor::block_on(other.create_physical_plan()).unwrap();
        let e = WeirCodec
            .try_encode(plan, &mut Vec::new(), &conv)
            .unwrap_err();
        assert!(
            e.to_string().contains("knows RecordedFilesExec only"),
            "{e}"
        );
    }
}
