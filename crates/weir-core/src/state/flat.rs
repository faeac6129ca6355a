//! The in-memory map a state store keeps its keys in: every key and value in one byte arena,
//! a hash table of arena offsets beside it.
//!
//! A `HashMap<Vec<u8>, Vec<u8>>` pays two vector headers (48 bytes) and a heap allocation
//! per key (at least 32 bytes for a short key) before the key's own bytes: about 115 bytes
//! of RSS per key for an 8-byte key. Here an entry is `[key length][value length][key]
//! [value]` (lengths as LEB128 varints, the value's length plus one, 0 meaning "removed")
//! appended to the arena, and the table holds its offset. Offsets are 4 bytes while the
//! arena is under 4 GiB and 8 bytes after (the table is rebuilt once, when the arena grows
//! past it): a table bucket is then 5 bytes (offset and hashbrown's control byte), and the
//! map about 30 bytes per 8-byte key. A replaced or removed entry stays in the arena as
//! garbage until [`FlatMap::compact`] copies the live entries into a new arena (the store
//! calls it after each commit, when garbage is more than half).

use std::hash::BuildHasher;

use hashbrown::{DefaultHashBuilder, HashTable};

/// An arena offset as the table holds it.
trait Slot: Copy {
    fn at(self) -> usize;
    fn from_at(at: usize) -> Self;
}

impl Slot for u32 {
    fn at(self) -> usize {
        self as usize
    }
    fn from_at(at: usize) -> Self {
        // Only while the arena is under `FlatMap::narrow_limit` (at most u32::MAX).
        at as u32
    }
}

impl Slot for u64 {
    fn at(self) -> usize {
        self as usize
    }
    fn from_at(at: usize) -> Self {
        at as u64
    }
}

/// The offsets: 4 bytes each while the arena is small enough, 8 after.
enum Table {
    Narrow(HashTable<u32>),
    Wide(HashTable<u64>),
}

impl Default for Table {
    fn default() -> Self {
        Table::Narrow(HashTable::new())
    }
}

/// Runs `$body` with `$t` bound to the table, whichever its width.
macro_rules! on_table {
    ($table:expr, $t:ident => $body:expr) => {
        match $table {
            Table::Narrow($t) => $body,
            Table::Wide($t) => $body,
        }
    };
}

/// Keys and values (or removals: `None`) of a state store, in one arena.
pub(crate) struct FlatMap {
    table: Table,
    arena: Vec<u8>,
    hasher: DefaultHashBuilder,
    /// Bytes of the arena no entry of the table points at.
    garbage: usize,
    /// The arena length up to which offsets fit the narrow table (u32::MAX; less in tests).
    narrow_limit: usize,
}

impl Default for FlatMap {
    fn default() -> Self {
        FlatMap {
            table: Table::default(),
            arena: Vec::new(),
            hasher: DefaultHashBuilder::default(),
            garbage: 0,
            narrow_limit: u32::MAX as usize,
        }
    }
}

impl std::fmt::Debug for FlatMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlatMap")
            .field("len", &self.len())
            .field("wide", &matches!(self.table, Table::Wide(_)))
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

fn varint_len(mut n: usize) -> usize {
    let mut len = 1;
    while n >= 0x80 {
        n >>= 7;
        len += 1;
    }
    len
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

fn entry_at(arena: &[u8], at: usize) -> Entry<'_> {
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

fn key_at<S: Slot>(arena: &[u8], slot: S) -> &[u8] {
    entry_at(arena, slot.at()).key
}

/// Sets the entry appended at `at` for `key` (hash `hash`) in `table`: returns the length
/// of the entry it replaced, which becomes garbage.
fn set<S: Slot>(
    table: &mut HashTable<S>,
    arena: &[u8],
    hasher: &DefaultHashBuilder,
    hash: u64,
    key: &[u8],
    at: usize,
) -> usize {
    match table.find_mut(hash, |old| key_at(arena, *old) == key) {
        Some(old) => {
            let len = entry_at(arena, old.at()).len;
            *old = S::from_at(at);
            len
        }
        None => {
            table.insert_unique(hash, S::from_at(at), |o| hasher.hash_one(key_at(arena, *o)));
            0
        }
    }
}

fn unset<S: Slot>(table: &mut HashTable<S>, arena: &[u8], hash: u64, key: &[u8]) -> Option<usize> {
    match table.find_entry(hash, |at| key_at(arena, *at) == key) {
        Ok(found) => {
            let (at, _) = found.remove();
            Some(entry_at(arena, at.at()).len)
        }
        Err(_) => None,
    }
}

fn compacted<S: Slot>(table: &mut HashTable<S>, old: &[u8], live: usize) -> Vec<u8> {
    let mut arena = Vec::with_capacity(live);
    for slot in table.iter_mut() {
        let start = slot.at();
        let e = entry_at(old, start);
        *slot = S::from_at(arena.len());
        arena.extend_from_slice(&old[start..start + e.len]);
    }
    arena
}

impl FlatMap {
    fn hash(&self, key: &[u8]) -> u64 {
        self.hasher.hash_one(key)
    }

    /// Number of keys.
    pub(crate) fn len(&self) -> usize {
        on_table!(&self.table, t => t.len())
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `Some(value)` for a key held (`Some(None)`: held as removed), `None` for a key not
    /// held.
    pub(crate) fn get(&self, key: &[u8]) -> Option<Option<&[u8]>> {
        let arena = &self.arena;
        let hash = self.hash(key);
        on_table!(&self.table, t => t
            .find(hash, |at| key_at(arena, *at) == key)
            .map(|at| entry_at(arena, at.at()).value))
    }

    pub(crate) fn contains_key(&self, key: &[u8]) -> bool {
        self.get(key).is_some()
    }

    /// Sets `key` to `value` (`None`: removed).
    pub(crate) fn insert(&mut self, key: &[u8], value: Option<&[u8]>) {
        let vlen = value.map_or(0, |v| v.len() + 1);
        let at = self.arena.len();
        let len = varint_len(key.len()) + varint_len(vlen) + key.len() + vlen.saturating_sub(1);
        if at + len > self.narrow_limit {
            self.widen();
        }
        put_varint(&mut self.arena, key.len());
        put_varint(&mut self.arena, vlen);
        self.arena.extend_from_slice(key);
        if let Some(v) = value {
            self.arena.extend_from_slice(v);
        }
        let hash = self.hash(key);
        let (arena, hasher) = (&self.arena, &self.hasher);
        self.garbage += on_table!(&mut self.table, t => set(t, arena, hasher, hash, key, at));
    }

    /// Offsets past the narrow table's reach are coming: the table becomes the wide one
    /// (once; every key is hashed again).
    fn widen(&mut self) {
        let Table::Narrow(narrow) = &self.table else {
            return;
        };
        let mut wide = HashTable::with_capacity(narrow.len());
        for at in narrow.iter() {
            let at = at.at();
            let hash = self.hasher.hash_one(entry_at(&self.arena, at).key);
            let arena = &self.arena;
            wide.insert_unique(hash, at as u64, |o| self.hasher.hash_one(key_at(arena, *o)));
        }
        self.table = Table::Wide(wide);
    }

    /// Drops `key` from the map (not a removal to record: the key is no longer held).
    pub(crate) fn remove(&mut self, key: &[u8]) -> bool {
        let hash = self.hash(key);
        let arena = &self.arena;
        match on_table!(&mut self.table, t => unset(t, arena, hash, key)) {
            Some(len) => {
                self.garbage += len;
                true
            }
            None => false,
        }
    }

    /// Every key and value (`None`: removed), in no particular order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&[u8], Option<&[u8]>)> {
        let arena = &self.arena;
        let (narrow, wide) = match &self.table {
            Table::Narrow(t) => (Some(t.iter().map(|s| s.at())), None),
            Table::Wide(t) => (None, Some(t.iter().map(|s| s.at()))),
        };
        narrow
            .into_iter()
            .flatten()
            .chain(wide.into_iter().flatten())
            .map(move |at| {
                let e = entry_at(arena, at);
                (e.key, e.value)
            })
    }

    /// Every key held with its value (removals left out), in key order. Sorts a list of
    /// offsets (8 bytes a key), not of the keys.
    pub(crate) fn sorted(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        let arena = &self.arena;
        let mut at: Vec<usize> = on_table!(&self.table, t => t.iter().map(|s| s.at()).collect());
        at.sort_unstable_by(|a, b| entry_at(arena, *a).key.cmp(entry_at(arena, *b).key));
        at.into_iter().filter_map(move |a| {
            let e = entry_at(arena, a);
            Some((e.key, e.value?))
        })
    }

    /// Empties the map, keeping its memory for the next use.
    pub(crate) fn clear(&mut self) {
        on_table!(&mut self.table, t => t.clear());
        self.arena.clear();
        self.garbage = 0;
    }

    /// The map's memory: the arena's and the table's allocations.
    pub(crate) fn memory_bytes(&self) -> usize {
        self.arena.capacity() + on_table!(&self.table, t => t.allocation_size())
    }

    /// Copies the live entries into a new arena when more than half of the arena is garbage.
    pub(crate) fn compact(&mut self) {
        if self.garbage * 2 <= self.arena.len() {
            return;
        }
        let live = self.arena.len() - self.garbage;
        let old = &self.arena;
        self.arena = on_table!(&mut self.table, t => compacted(t, old, live));
        self.garbage = 0;
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    /// The map against a `HashMap` under puts, replacements, removals and compactions,
    /// with 4-byte offsets throughout, and with the table widened to 8-byte offsets midway
    /// (a limit of a few kilobytes stands for 4 GiB).
    #[test]
    fn it_holds_what_a_hash_map_holds() {
        let narrow = holds_what_a_hash_map_holds(u32::MAX as usize);
        assert!(matches!(narrow.table, Table::Narrow(_)));
        let widened = holds_what_a_hash_map_holds(50_000);
        assert!(matches!(widened.table, Table::Wide(_)));
    }

    fn holds_what_a_hash_map_holds(narrow_limit: usize) -> FlatMap {
        let mut flat = FlatMap {
            narrow_limit,
            ..FlatMap::default()
        };
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
        let sorted: Vec<(Vec<u8>, Vec<u8>)> = flat
            .sorted()
            .map(|(k, v)| (k.to_vec(), v.to_vec()))
            .collect();
        let want_sorted: Vec<(Vec<u8>, Vec<u8>)> = want
            .iter()
            .filter_map(|(k, v)| Some((k.clone(), v.clone()?)))
            .collect();
        assert_eq!(
            sorted, want_sorted,
            "held keys in key order, removals left out"
        );
        flat.compact();
        assert!(flat.garbage == 0 || flat.garbage * 2 <= flat.arena.len());
        flat.clear();
        assert!(flat.is_empty() && flat.get(b"x").is_none());
        flat.insert(b"k", Some(&b"v"[..]));
        assert_eq!(flat.get(b"k"), Some(Some(&b"v"[..])));
        flat
    }

    #[test]
    fn varints_round_trip() {
        for n in [0usize, 1, 127, 128, 300, 16_383, 16_384, 1 << 40] {
            let mut out = Vec::new();
            put_varint(&mut out, n);
            assert_eq!(get_varint(&out), (n, out.len()), "{n}");
            assert_eq!(varint_len(n), out.len(), "{n}");
        }
    }
}
