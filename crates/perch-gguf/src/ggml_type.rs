//! ggml tensor element types: ids, names and block sizes.

use std::fmt;

/// Element type of a tensor, as ggml numbers it (`enum ggml_type` in `ggml.h`).
///
/// The types the importer converts have their own variants; every other id is `Other`, whose
/// name and block size still come from [`GgmlType::name`] and [`GgmlType::block_layout`] when
/// the id is a known ggml type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q8_0,
    BF16,
    /// Any other ggml type id (K-quants, I-quants, integer types, ids newer than this crate).
    Other(u32),
}

/// `(id, name, elements per block, bytes per block)` for every ggml type id in use
/// (from `ggml.c` `type_traits` / gguf-py `GGML_QUANT_SIZES`). Ids 4, 5 and 31..33, 36..38 were
/// removed from ggml and are absent here on purpose.
const GGML_TYPE_TABLE: &[(u32, &str, u64, u64)] = &[
    (0, "F32", 1, 4),
    (1, "F16", 1, 2),
    (2, "Q4_0", 32, 18),
    (3, "Q4_1", 32, 20),
    (6, "Q5_0", 32, 22),
    (7, "Q5_1", 32, 24),
    (8, "Q8_0", 32, 34),
    (9, "Q8_1", 32, 40),
    (10, "Q2_K", 256, 84),
    (11, "Q3_K", 256, 110),
    (12, "Q4_K", 256, 144),
    (13, "Q5_K", 256, 176),
    (14, "Q6_K", 256, 210),
    (15, "Q8_K", 256, 292),
    (16, "IQ2_XXS", 256, 66),
    (17, "IQ2_XS", 256, 74),
    (18, "IQ3_XXS", 256, 98),
    (19, "IQ1_S", 256, 50),
    (20, "IQ4_NL", 32, 18),
    (21, "IQ3_S", 256, 110),
    (22, "IQ2_S", 256, 82),
    (23, "IQ4_XS", 256, 136),
    (24, "I8", 1, 1),
    (25, "I16", 1, 2),
    (26, "I32", 1, 4),
    (27, "I64", 1, 8),
    (28, "F64", 1, 8),
    (29, "IQ1_M", 256, 56),
    (30, "BF16", 1, 2),
    (34, "TQ1_0", 256, 54),
    (35, "TQ2_0", 256, 66),
    (39, "MXFP4", 32, 17),
];

impl GgmlType {
    /// The type for a ggml type id as stored in a tensor info.
    pub fn from_id(id: u32) -> Self {
        match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            8 => GgmlType::Q8_0,
            30 => GgmlType::BF16,
            other => GgmlType::Other(other),
        }
    }

    /// The ggml type id.
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q8_0 => 8,
            GgmlType::BF16 => 30,
            GgmlType::Other(id) => id,
        }
    }

    fn table_entry(self) -> Option<&'static (u32, &'static str, u64, u64)> {
        let id = self.id();
        GGML_TYPE_TABLE.iter().find(|entry| entry.0 == id)
    }

    /// The ggml name (`"Q4_1"`, `"Q6_K"`, ...), or `None` for an id ggml does not define.
    pub fn name(self) -> Option<&'static str> {
        self.table_entry().map(|entry| entry.1)
    }

    /// `(elements per block, bytes per block)`; `None` for an id ggml does not define.
    /// Unquantized types are blocks of one element.
    pub fn block_layout(self) -> Option<(u64, u64)> {
        self.table_entry().map(|entry| (entry.2, entry.3))
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(name) => f.write_str(name),
            None => write!(f, "unknown ggml type {}", self.id()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_names_come_from_the_ggml_table() {
        assert_eq!(GgmlType::from_id(12).to_string(), "Q4_K");
        assert_eq!(GgmlType::from_id(3), GgmlType::Q4_1);
        assert_eq!(GgmlType::Q8_0.block_layout(), Some((32, 34)));
        assert_eq!(
            GgmlType::from_id(4).name(),
            None,
            "id 4 was removed from ggml"
        );
        assert_eq!(GgmlType::from_id(4).to_string(), "unknown ggml type 4");
    }
}
