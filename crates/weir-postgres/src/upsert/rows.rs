//! Loading a batch's rows into a table: binary COPY a chunk at a time, or INSERT.

use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, CopyInSink};

use super::{COPY_CHUNK, Columns, PostgresUpsert};
use crate::error::PostgresSinkError;
use crate::types::{COPY_HEADER, COPY_TRAILER, Cell};

/// Why a COPY stopped: a value that cannot be encoded (the column's index, past the batch's
/// columns for the `extra` cells), or the server.
#[derive(Debug)]
pub(crate) enum CopyFailure {
    Value(usize, String),
    Db(tokio_postgres::Error),
}

/// Binary COPY data streamed into a `COPY .. FROM STDIN`, encoded a chunk at a time (each
/// about [`COPY_CHUNK`] bytes, queued without waiting for the server in between), with the
/// `extra` cells (text, then int8) after each row's. Dropped before
/// [`CopyWriter::finish`], the COPY is aborted and nothing of it lands.
pub(crate) struct CopyWriter {
    sink: std::pin::Pin<Box<CopyInSink<bytes::Bytes>>>,
    types: Vec<Type>,
    buf: bytes::BytesMut,
}

impl CopyWriter {
    /// `types`: one per field of a row, the `extra` cells' included.
    pub(crate) fn new(sink: CopyInSink<bytes::Bytes>, types: Vec<Type>) -> Self {
        let mut buf = bytes::BytesMut::with_capacity(COPY_CHUNK + 4096);
        buf.extend_from_slice(COPY_HEADER);
        CopyWriter {
            sink: Box::pin(sink),
            types,
            buf,
        }
    }

    /// Every row of `rows`, each followed by `extra`.
    pub(crate) async fn put(
        &mut self,
        rows: &crate::types::CopyRows,
        extra: &[Cell<'_>],
    ) -> Result<(), CopyFailure> {
        use futures::SinkExt;
        for row in 0..rows.rows() {
            rows.put_copy_row(row, &self.types, extra, &mut self.buf)
                .map_err(|(i, reason)| CopyFailure::Value(i, reason))?;
            if self.buf.len() >= COPY_CHUNK {
                let chunk = self.buf.split().freeze();
                self.sink
                    .as_mut()
                    .feed(chunk)
                    .await
                    .map_err(CopyFailure::Db)?;
            }
        }
        Ok(())
    }

    /// Ends the COPY: the rows the server took.
    pub(crate) async fn finish(mut self) -> Result<u64, tokio_postgres::Error> {
        use futures::SinkExt;
        self.buf.extend_from_slice(COPY_TRAILER);
        let rest = self.buf.split().freeze();
        self.sink.as_mut().feed(rest).await?;
        self.sink.as_mut().finish().await
    }
}

/// The name of column `i` of a COPY of `names` and the staging table's own columns.
pub(crate) fn copy_column(names: &[String], i: usize) -> String {
    names.get(i).cloned().unwrap_or_else(|| {
        let own = super::on_workers::STAGING_COLUMNS;
        own[(i - names.len()).min(own.len() - 1)].into()
    })
}

impl PostgresUpsert {
    /// Streams `batches` into `sink` with a [`CopyWriter`]. A value that cannot be encoded
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
        let mut types = cols.types.clone();
        if !extra.is_empty() {
            types.extend([Type::TEXT, Type::INT8]);
        }
        let mut copy = CopyWriter::new(sink, types);
        for b in batches {
            copy.put(b, extra).await.map_err(|e| match e {
                CopyFailure::Value(i, reason) => PostgresSinkError::BadValue {
                    table: self.table.clone(),
                    batch_id: id,
                    column: copy_column(&cols.names, i),
                    reason,
                },
                CopyFailure::Db(e) => self.db(id, action)(e),
            })?;
        }
        copy.finish().await.map_err(self.db(id, action))
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
