//! Test-only GGUF writer: builds small files in the exact on-disk format so the reader and the
//! importer can be tested on inputs the real model does not contain (other types, bad headers).

use std::path::Path;

use crate::ggml_type::GgmlType;
use crate::reader::MetadataValue;

pub(crate) struct GgufBuilder {
    pub(crate) version: u32,
    pub(crate) alignment: usize,
    kvs: Vec<(String, MetadataValue)>,
    tensors: Vec<(String, Vec<u64>, GgmlType, Vec<u8>)>,
}

impl GgufBuilder {
    pub(crate) fn new() -> Self {
        GgufBuilder {
            version: 3,
            alignment: 32,
            kvs: Vec::new(),
            tensors: Vec::new(),
        }
    }

    pub(crate) fn kv(&mut self, key: &str, value: MetadataValue) -> &mut Self {
        self.kvs.retain(|(k, _)| k != key);
        self.kvs.push((key.to_string(), value));
        self
    }

    pub(crate) fn remove_kv(&mut self, key: &str) -> &mut Self {
        self.kvs.retain(|(k, _)| k != key);
        self
    }

    /// `dims` innermost-first, as GGUF stores them; `data` is the raw ggml bytes.
    pub(crate) fn tensor(
        &mut self,
        name: &str,
        dims: &[u64],
        ggml_type: GgmlType,
        data: Vec<u8>,
    ) -> &mut Self {
        self.tensors.retain(|(n, ..)| n != name);
        self.tensors
            .push((name.to_string(), dims.to_vec(), ggml_type, data));
        self
    }

    pub(crate) fn remove_tensor(&mut self, name: &str) -> &mut Self {
        self.tensors.retain(|(n, ..)| n != name);
        self
    }

    pub(crate) fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.kvs.len() as u64).to_le_bytes());
        for (key, value) in &self.kvs {
            write_string(&mut out, key);
            out.extend_from_slice(&type_code(value).to_le_bytes());
            write_value(&mut out, value);
        }
        let mut offset = 0usize;
        let mut offsets = Vec::new();
        for (name, dims, ggml_type, data) in &self.tensors {
            write_string(&mut out, name);
            out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&ggml_type.id().to_le_bytes());
            out.extend_from_slice(&(offset as u64).to_le_bytes());
            offsets.push(offset);
            offset = (offset + data.len()).div_ceil(self.alignment) * self.alignment;
        }
        let data_start = out.len().div_ceil(self.alignment) * self.alignment;
        out.resize(data_start, 0);
        for ((.., data), offset) in self.tensors.iter().zip(offsets) {
            out.resize(data_start + offset, 0);
            out.extend_from_slice(data);
        }
        out
    }

    pub(crate) fn write(&self, path: &Path) {
        std::fs::write(path, self.to_bytes()).expect("write test GGUF");
    }
}

fn write_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn type_code(value: &MetadataValue) -> u32 {
    match value {
        MetadataValue::U8(_) => 0,
        MetadataValue::I8(_) => 1,
        MetadataValue::U16(_) => 2,
        MetadataValue::I16(_) => 3,
        MetadataValue::U32(_) => 4,
        MetadataValue::I32(_) => 5,
        MetadataValue::F32(_) => 6,
        MetadataValue::Bool(_) => 7,
        MetadataValue::String(_) => 8,
        MetadataValue::Array(_) => 9,
        MetadataValue::U64(_) => 10,
        MetadataValue::I64(_) => 11,
        MetadataValue::F64(_) => 12,
    }
}

fn write_value(out: &mut Vec<u8>, value: &MetadataValue) {
    match value {
        MetadataValue::U8(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetadataValue::I8(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetadataValue::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetadataValue::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetadataValue::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetadataValue::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetadataValue::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetadataValue::Bool(v) => out.push(u8::from(*v)),
        MetadataValue::String(s) => write_string(out, s),
        MetadataValue::Array(items) => {
            // An empty array's item type is irrelevant; u8 keeps it valid.
            let item_type = items.first().map_or(0, type_code);
            out.extend_from_slice(&item_type.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                write_value(out, item);
            }
        }
        MetadataValue::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetadataValue::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
        MetadataValue::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
    }
}
