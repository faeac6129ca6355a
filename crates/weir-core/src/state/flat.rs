//! The in-memory map a state store keeps its keys in: every key and value in one byte arena,
//! a hash table of arena offsets beside it.
//!
//! A `HashMap<Vec<u8>, Vec<u8>>` pays two vector headers (48 bytes) and a heap allocation
//! per key (at least 32 bytes for a short key) before the key's own bytes: about 115 bytes
//! of RSS per key for an 8-byte key. Here an entry is `[key length][value length][key]
//! [value]` (lengths as LEB128 varints, the value's length plus one, 0 meaning "removed")
//! appended to the arena, and the table holds its 8-byte offset: about 25-35 bytes per
//! 8-byte key. A replaced or removed entry stays in the arena as garbage until
//! [`FlatMap::compact`] copies the live entries into a new arena (the store calls it after
//! each commit, when garbage is more than half).

use std::hash::BuildHasher;

use hashbrown::{DefaultHashBuilder, HashTable};

/// Keys and values (or removals: `None`) of a state store, in one arena.
#[derive(Default)]
pub(crate) struct FlatMap {
    table: HashTable<u64>,
    arena: Vec<u8>,
    hasher: DefaultHashBuilder,
    /// Bytes of the arena no entry of the table points at.
    garbage: usize,
}

impl std::fmt::Debug for FlatMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlatMap")
            .field("len", &self.table.len())
            .field("arena", &self.arena.len())
            .field("garbage", &self.garbage)
            .finish()
    }
}

fn put_varint(out: &mut Vec<u8>, mut n: usize) {
    while n >= 0x80 {
        out.push((n as u8 & 0x7f) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
}

/// The varint at the start of `bytes` and its length. The arena is written only by
/// [`put_varint`], so a varint is always whole.
fn get_varint(bytes: &[u8]) -> (usize, usize) {
    let mut n = 0usize;
    for (i, b) in bytes.iter().enumerate() {
        n |= usize::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return (n, i + 1);
        }
    }
    (n, bytes.len())
}

/// An entry of the arena: its key, its value (`None`: removed) and its length in bytes.
struct Entry<'a> {
    key: &'a [u8],
    value: Option<&'a [u8]>,
    len: usize,
}

fn entry_at(arena: &[u8], at: u64) -> Entry<'_> {
    let at = at as usize;
    let (klen, a) = get_varint(&arena[at..]);
    let (vlen, b) = get_varint(&arena[at + a..]);
    let start = at + a + b;
    let key = &arena[start..start + klen];
    let (value, vbytes) = match vlen {
        0 => (None, 0),
        n => (Some(&arena[start + klen..start + klen + n - 1]), n - 1),
    };
    Entry {
        key,
        value,
        len: a + b + klen + vbytes,
    }
}

impl FlatMap {
    fn hash(&self, key: &[u8]) -> u64 {
        self.hasher.hash_one(key)
    }

    /// Number of keys.
    pub(crate) fn len(&self) -> usize {
        self.table.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// `Some(value)` for a key held (`Some(None)`: held as removed), `None` for a key not
    /// held.
    pub(crate) fn get(&self, key: &[u8]) -> Option<Option<&[u8]>> {
        let arena = &self.arena;
        self.table
            .find(self.hash(key), |at| entry_at(arena, *at).key == key)
            .map(|at| entry_at(arena, *at).value)
    }

    pub(crate) fn contains_key(&self, key: &[u8]) -> bool {
        self.get(key).is_some()
    }

    /// Sets `key` to `value` (`None`: removed).
    pub(crate) fn insert(&mut self, key: &[u8], value: Option<&[u8]>) {
        let at = self.arena.len() as u64;
        put_varint(&mut self.arena, key.len());
        put_varint(&mut self.arena, value.map_or(0, |v| v.len() + 1));
        self.arena.extend_from_slice(key);
        if let Some(v) = value {
            self.arena.extend_from_slice(v);
        }
        let hash = self.hash(key);
        let arena = &self.arena;
        match self
            .table
            .find_mut(hash, |old| entry_at(arena, *old).key == key)
        {
            Some(old) => {
                self.garbage += entry_at(arena, *old).len;
                *old = at;
            }
            None => {
                let hasher = &self.hasher;
                self.table
                    .insert_unique(hash, at, |o| hasher.hash_one(entry_at(arena, *o).key));
            }
        }
    }

    /// Drops `key` from the map (not a removal to record: the key is no longer held).
    pub(crate) fn remove(&mut self, key: &[u8]) -> bool {
        let hash = self.hash(key);
        let arena = &self.arena;
        match self
            .table
            .find_entry(hash, |at| entry_at(arena, *at).key == key)
        {
            Ok(found) => {
                let (at, _) = found.remove();
                self.garbage += entry_at(arena, at).len;
                true
            }
            Err(_) => false,
        }
    }

    /// Every key and value (`None`: removed), in no particular order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&[u8], Option<&[u8]>)> {
        let arena = &self.arena;
        self.table.iter().map(move |at| {
            let e = entry_at(arena, *at);
            (e.key, e.value)
        })
    }

    /// Empties the map, keeping its memory for the next use.
    pub(crate) fn clear(&mut self) {
        self.table.clear();
        self.arena.clear();
        self.garbage = 0;
    }

    /// The map's memory: the arena's and the table's allocations.
    pub(crate) fn memory_bytes(&self) -> usize {
        self.arena.capacity() + self.table.allocation_size()
    }

    /// Copies the live entries into a new arena when more than half of the arena is garbage.
    pub(crate) fn compact(&mut self) {
        if self.garbage * 2 <= self.arena.len() {
            return;
        }
        let mut arena = Vec::with_capacity(self.arena.len() - self.garbage);
        for at in self.table.iter_mut() {
            let e = entry_at(&self.arena, *at);
            let start = *at as usize;
            let new_at = arena.len() as u64;
            arena.extend_from_slice(&self.arena[start..start + e.len]);
            *at = new_at;
        }
        self.arena = arena;
        self.garbage = 0;
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    /// The map against a `HashMap` under puts, replacements, removals and compactions.
    #[test]
    fn it_holds_what_a_hash_map_holds() {
        let mut flat = FlatMap::default();
        let mut reference: HashMap<Vec<u8>, Option<Vec<u8>>> = HashMap::new();
        let mut seed: u64 = 7;
        let mut next = move |m: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % m
        };
        for round in 0..20_000u64 {
            let key = next(3000).to_le_bytes()[..1 + next(8) as usize].to_vec();
            match next(10) {
                0..=5 => {
                    let value: Vec<u8> = (0..next(300)).map(|i| i as u8).collect();
                    flat.insert(&key, Some(&value));
                    reference.insert(key, Some(value));
                }
                6 => {
                    flat.insert(&key, None);
                    reference.insert(key, None);
                }
                _ => {
                    assert_eq!(flat.remove(&key), reference.remove(&key).is_some());
                }
            }
            if round % 997 == 0 {
                flat.compact();
            }
        }
        assert_eq!(flat.len(), reference.len());
        for (k, v) in &reference {
            assert_eq!(flat.get(k), Some(v.as_deref()), "{k:?}");
        }
        let mut listed: Vec<(Vec<u8>, Option<Vec<u8>>)> = flat
            .iter()
            .map(|(k, v)| (k.to_vec(), v.map(<[u8]>::to_vec)))
            .collect();
        listed.sort();
        let mut want: Vec<(Vec<u8>, Option<Vec<u8>>)> = reference.into_iter().collect();
        want.sort();
        assert_eq!(listed, want);
        flat.compact();
        assert!(flat.garbage == 0 || flat.garbage * 2 <= flat.arena.len());
        flat.clear();
        assert!(flat.is_empty() && flat.get(b"x").is_none());
    }

    #[test]
    fn varints_round_trip() {
        for n in [0usize, 1, 127, 128, 300, 16_383, 16_384, 1 << 40] {
            let mut out = Vec::new();
            put_varint(&mut out, n);
            assert_eq!(get_varint(&out), (n, out.len()), "{n}");
        }
    }
}
