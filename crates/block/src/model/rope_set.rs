//! The rotary tables of one forward pass, one per distinct rotation among the blocks:
//! most models rotate every block alike, Gemma 3's local and global layers at different
//! bases.

use candle_core::{Result, Tensor};
use mha::{Rope, RopeTables};

/// The tables of positions `[b, t]` for each distinct [`Rope`] of the model's blocks (at
/// most a handful, so a list searched by equality).
#[derive(Debug, Clone, Default)]
pub struct RopeSet {
    tables: Vec<(Rope, RopeTables)>,
}

impl RopeSet {
    /// The tables of `pos` (`[b, t]`) for every rotation in `ropes`, each made once.
    pub fn new<'a>(ropes: impl Iterator<Item = &'a Rope>, pos: &Tensor) -> Result<Self> {
        let mut tables: Vec<(Rope, RopeTables)> = Vec::new();
        for rope in ropes {
            if !tables.iter().any(|(r, _)| r == rope) {
                tables.push((rope.clone(), rope.tables(pos)?));
            }
        }
        Ok(Self { tables })
    }

    /// The tables of a block that rotates by `rope`; `None` for a block that does not.
    pub fn get(&self, rope: Option<&Rope>) -> Option<&RopeTables> {
        let rope = rope?;
        self.tables.iter().find(|(r, _)| r == rope).map(|(_, t)| t)
    }

    /// Whether no block rotates (learned positions, or none at all).
    pub fn is_empty(&self) -> bool {
        self.tables.is_empty()
    }
}
