//! Settings for object stores: the `[storage]` table of a pipeline.

use std::collections::BTreeMap;
use std::fmt;

use object_store::aws::AmazonS3ConfigKey;
use object_store::azure::AzureConfigKey;
use object_store::gcp::GoogleConfigKey;

use crate::error::{Error, Result};

/// Object-store settings, passed to the store of every `s3://`, `az://` or `gs://` location
/// (keys as `object_store` spells them: `aws_endpoint`, `aws_region`, `allow_http`,
/// `azure_storage_account_name`, `google_service_account`, ...). Each store takes the keys
/// it knows; a key that no store knows is refused. Credentials not given here come from each
/// cloud's standard chain (environment, web/workload identity, instance metadata).
///
/// Values may be secrets: they are never printed (`Debug` shows the keys only).
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct StorageOptions {
    values: BTreeMap<String, String>,
}

impl fmt::Debug for StorageOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.values.keys()).finish()
    }
}

/// Which object stores know a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cloud {
    S3,
    Azure,
    Gcs,
}

pub(crate) fn known_by(cloud: Cloud, key: &str) -> bool {
    let k = key.to_ascii_lowercase();
    match cloud {
        Cloud::S3 => k.parse::<AmazonS3ConfigKey>().is_ok(),
        Cloud::Azure => k.parse::<AzureConfigKey>().is_ok(),
        Cloud::Gcs => k.parse::<GoogleConfigKey>().is_ok(),
    }
}

impl StorageOptions {
    /// Checks every key: one that no object store knows is an error naming it.
    pub fn new(values: BTreeMap<String, String>) -> Result<Self> {
        for k in values.keys() {
            if ![Cloud::S3, Cloud::Azure, Cloud::Gcs]
                .iter()
                .any(|c| known_by(*c, k))
            {
                return Err(Error::config(
                    format!("storage.{k}"),
                    "not a setting of the S3, Azure or GCS object store (see the object_store \
                     crate's AmazonS3ConfigKey, AzureConfigKey and GoogleConfigKey)",
                ));
            }
        }
        Ok(StorageOptions { values })
    }

    /// No settings.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// The settings, for handing to delta-rs (never print them).
    pub fn as_map(&self) -> &BTreeMap<String, String> {
        &self.values
    }

    /// The settings a store of `cloud` takes.
    pub(crate) fn for_cloud(&self, cloud: Cloud) -> impl Iterator<Item = (&str, &str)> {
        self.values
            .iter()
            .filter(move |(k, _)| known_by(cloud, k))
            .map(|(k, v)| (k.as_str(), v.as_str()))
    }
}
