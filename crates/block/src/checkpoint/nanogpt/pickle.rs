//! A dry run of a pickle before Candle's unpickler sees it.
//!
//! Candle's `pickle::Stack` trusts its input: a string length is allocated before it is
//! read (a 4 GB `malloc` from a 30-byte file, found by fuzzing), every memo get deep-copies
//! the object (a few hundred bytes can ask for exponentially many copies), nesting has no
//! bound (dropping a million nested tuples overflows the stack), and `LONG1` shifts past 64
//! bits. This pass walks the same opcodes tracking only each object's size and depth, and
//! refuses the pickle when any of those would go out of bounds.

use candle_core::{bail, Result};

/// Objects (and 32-byte chunks of strings) the unpickler may build in all, copies
/// included. A nanoGPT `data.pkl` builds a few thousand.
const MAX_UNITS: u64 = 1 << 22;
/// Deepest nesting accepted; checkpoints nest about 6 deep.
const MAX_DEPTH: u32 = 64;

#[derive(Clone, Copy)]
struct Item {
    units: u64,
    depth: u32,
    mark: bool,
}

const LEAF: Item = Item {
    units: 1,
    depth: 1,
    mark: false,
};

struct Bytes<'a>(&'a [u8]);

impl<'a> Bytes<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if n > self.0.len() {
            bail!(
                "pickle: truncated ({n} bytes wanted, {} left)",
                self.0.len()
            )
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn u32(&mut self) -> Result<u32> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn line(&mut self) -> Result<&'a [u8]> {
        let n = self
            .0
            .iter()
            .position(|&b| b == b'\n')
            .map_or(self.0.len(), |p| p + 1);
        self.take(n)
    }
}

/// Checks that Candle's unpickler can run `data` within bounded memory and stack.
pub(crate) fn check(data: &[u8]) -> Result<()> {
    let mut r = Bytes(data);
    let mut stack: Vec<Item> = Vec::new();
    let mut memo = std::collections::HashMap::<u32, Item>::new();
    let mut spent: u64 = 0;
    let pop = |stack: &mut Vec<Item>| {
        stack
            .pop()
            .ok_or_else(|| candle_core::Error::Msg("pickle: pop from an empty stack".into()))
    };
    let pop_to_mark = |stack: &mut Vec<Item>| -> Result<Item> {
        let Some(at) = stack.iter().rposition(|i| i.mark) else {
            bail!("pickle: no mark on the stack")
        };
        let items = stack.split_off(at + 1);
        stack.pop();
        Ok(join(&items))
    };
    loop {
        let op = r.take(1)?[0];
        let pushed = match op {
            0x80 => {
                r.take(1)?; // PROTO
                None
            }
            b'c' => {
                let n = r.line()?.len() + r.line()?.len(); // GLOBAL module\nname\n
                Some(Item {
                    units: 1 + n as u64 / 32,
                    ..LEAF
                })
            }
            b'X' => {
                let n = r.u32()? as usize; // BINUNICODE: checked against what is left
                r.take(n)?;
                Some(Item {
                    units: 1 + n as u64 / 32,
                    ..LEAF
                })
            }
            b'K' => Some(r.take(1).map(|_| LEAF)?),
            b'M' => Some(r.take(2).map(|_| LEAF)?),
            b'J' => Some(r.take(4).map(|_| LEAF)?),
            b'G' => Some(r.take(8).map(|_| LEAF)?),
            0x8a => {
                let n = r.take(1)?[0];
                if n > 8 {
                    bail!("pickle: LONG1 of {n} bytes does not fit in 64 bits")
                }
                r.take(n as usize)?;
                Some(LEAF)
            }
            b')' | b'}' | b'd' | b']' | b'N' | 0x88 | 0x89 => Some(LEAF),
            b'(' => Some(Item { mark: true, ..LEAF }),
            b'.' => return Ok(()),
            b'q' | b'r' => {
                let id = if op == b'q' {
                    r.take(1)?[0] as u32
                } else {
                    r.u32()?
                };
                let top = *stack.last().ok_or_else(|| {
                    candle_core::Error::Msg("pickle: memo put on an empty stack".into())
                })?;
                spent = spent.saturating_add(top.units);
                memo.insert(id, top);
                None
            }
            b'h' | b'j' => {
                let id = if op == b'h' {
                    r.take(1)?[0] as u32
                } else {
                    r.u32()?
                };
                let Some(item) = memo.get(&id) else {
                    bail!("pickle: memo {id} read before it is written")
                };
                Some(*item)
            }
            b'Q' => Some(join(&[pop(&mut stack)?])), // BINPERSID
            0x85..=0x87 => {
                let n = (op - 0x84) as usize; // TUPLE1..3
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(pop(&mut stack)?);
                }
                Some(join(&items))
            }
            b'R' | 0x81 | b'b' => {
                let (a, b) = (pop(&mut stack)?, pop(&mut stack)?); // REDUCE, NEWOBJ, BUILD
                Some(join(&[a, b]))
            }
            b't' => Some(pop_to_mark(&mut stack)?),
            b'a' | b's' | b'e' | b'u' => {
                // APPEND, SETITEM(S), APPENDS: into the container below.
                let added = match op {
                    b'a' => pop(&mut stack)?,
                    b's' => join(&[pop(&mut stack)?, pop(&mut stack)?]),
                    _ => pop_to_mark(&mut stack)?,
                };
                let Some(top) = stack.last_mut() else {
                    bail!("pickle: append to an empty stack")
                };
                *top = join(&[*top, added]);
                check_item(top)?;
                None
            }
            other => bail!("pickle: unsupported opcode 0x{other:02x}"),
        };
        if let Some(item) = pushed {
            check_item(&item)?;
            spent = spent.saturating_add(item.units);
            stack.push(item);
        }
        if spent > MAX_UNITS {
            bail!("pickle: builds more than {MAX_UNITS} objects (copies through the memo included)")
        }
    }
}

/// A container of `items`.
fn join(items: &[Item]) -> Item {
    Item {
        units: items.iter().fold(1u64, |u, i| u.saturating_add(i.units)),
        depth: 1 + items.iter().map(|i| i.depth).max().unwrap_or(0),
        mark: false,
    }
}

fn check_item(item: &Item) -> Result<()> {
    if item.depth > MAX_DEPTH {
        bail!("pickle: objects nested more than {MAX_DEPTH} deep")
    }
    if item.units > MAX_UNITS {
        bail!("pickle: an object of more than {MAX_UNITS} parts")
    }
    Ok(())
}
