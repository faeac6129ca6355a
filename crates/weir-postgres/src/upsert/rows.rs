//! Loading a batch's rows into a table: binary COPY a chunk at a time, or INSERT.

use futures::pin_mut;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, CopyInSink};

use super::{COPY_CHUNK, Columns, PostgresUpsert};
use crate::error::PostgresSinkError;
use crate::types::{COPY_HEADER, COPY_TRAILER, Cell};

impl PostgresUpsert {
    /// Streams `batches` as binary COPY data into `sink`, encoded a chunk at a time (each
    /// about [`COPY_CHUNK`] bytes, queued without waiting for the server in between), with
    /// the `extra` cells (text, then int8) after each row's. A value that cannot be encoded
    /// aborts the COPY, so nothing of it lands.
    pub(super) async fn copy_rows(
        &self,
        id: u64,
        action: &'static str,
        sink: CopyInSink<bytes::Bytes>,
        cols: &Columns,
        batches: &[crate::types::CopyRows],
        extra: &[Cell<'_>],
    ) -> Result<u64, PostgresSinkError> {
        use futures::SinkExt;
        let mut types = cols.types.clone();
        if !extra.is_empty() {
            types.extend([Type::TEXT, Type::INT8]);
        }
        pin_mut!(sink);
        let mut buf = bytes::BytesMut::with_capacity(COPY_CHUNK + 4096);
        buf.extend_from_slice(COPY_HEADER);
        for b in batches {
            for row in 0..b.rows() {
                b.put_copy_row(row, &types, extra, &mut buf)
                    .map_err(|(i, reason)| PostgresSinkError::BadValue {
                        table: self.table.clone(),
                        batch_id: id,
                        // Past the batch's columns: the two ledger columns.
                        column: cols.names.get(i).cloned().unwrap_or_else(|| {
                            ["weir_app_id", "weir_batch_id"][(i - cols.names.len()).min(1)].into()
                        }),
                        reason,
                    })?;
                if buf.len() >= COPY_CHUNK {
                    let chunk = buf.split().freeze();
                    sink.as_mut()
                        .feed(chunk)
                        .await
                        .map_err(self.db(id, action))?;
                }
            }
        }
        buf.extend_from_slice(COPY_TRAILER);
        sink.as_mut()
            .feed(buf.freeze())
            .await
            .map_err(self.db(id, action))?;
        sink.finish().await.map_err(self.db(id, action))
    }

    pub(super) async fn insert_rows(
        tx: &Client,
        temp: &str,
        list: &str,
        cols: &Columns,
        batches: &[crate::types::CopyRows],
    ) -> Result<(), tokio_postgres::Error> {
        let width = cols.names.len().max(1);
        let per_stmt = (65_535 / width).min(1000);
        for b in batches {
            let mut start = 0;
            while start < b.rows() {
                let n = per_stmt.min(b.rows() - start);
                let cells: Vec<crate::types::Cell> =
                    (start..start + n).flat_map(|row| b.row(row)).collect();
                let values: Vec<String> = (0..n)
                    .map(|r| {
                        let ps: Vec<String> = (0..width)
                            .map(|c| format!("${}::{}", r * width + c + 1, cols.sql_types[c]))
                            .collect();
                        format!("({})", ps.join(", "))
                    })
                    .collect();
                let sql = format!("INSERT INTO {temp} ({list}) VALUES {}", values.join(", "));
                let params: Vec<&(dyn ToSql + Sync)> =
                    cells.iter().map(|c| c as &(dyn ToSql + Sync)).collect();
                tx.execute(&sql, &params).await?;
                start += n;
            }
        }
        Ok(())
    }
}
