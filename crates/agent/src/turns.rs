//! Tenants take turns for an agent's call slots, as they do in the
//! agents' lines (migration 0027): the requests an agent holds beyond its
//! call slots wait in order of their tenant's turn, not of arrival, so a
//! tenant whose burst fills the agent does not stand before a quiet
//! tenant's request.
//!
//! Start-time fair queueing in virtual time, per level (the order's
//! priority, and undo apart): a request takes `max(its level's head, its
//! tenant's last turn at that level + 1)`, and a level's head moves to the
//! turn of each request of that level given a slot (an urgent request
//! served first moves only its own level's head). A tenant with nothing waiting starts at
//! the head (the next place); a busy one goes on from its last turn, one
//! turn per request. A turn is worth a millisecond of the lines' rule
//! ([`crate::handler::slot_priority`]): a priority level, 10 s there, is a
//! head start of 10,000 turns here. While the lane holds no request at all
//! its turns start again from 0 (nothing compares with them then).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// One lane's turns (see the module docs).
#[derive(Debug, Default)]
pub struct Turns {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Each level's head: the turn of its last request given a slot.
    heads: HashMap<i64, i64>,
    /// Each tenant's last turn taken, by level.
    last: HashMap<(i64, String), i64>,
    /// Requests holding a turn (from arrival to their end).
    held: usize,
}

/// A request's turn, held until the request ends.
#[derive(Debug)]
pub struct Turn {
    turns: Arc<Turns>,
    level: i64,
    /// Its place in virtual time, within its level.
    pub at: i64,
}

impl Turns {
    /// Takes the next turn of `tenant` at `level` (a request's head start,
    /// [`crate::handler::slot_priority`]) for a request that just arrived.
    pub fn take(self: &Arc<Self>, tenant: &str, level: i64) -> Turn {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if state.held == 0 {
            state.heads.clear();
            state.last.clear();
        }
        state.held += 1;
        let head = state.heads.get(&level).copied().unwrap_or(0);
        let key = (level, tenant.to_owned());
        let at = match state.last.get(&key) {
            Some(&last) => head.max(last + 1),
            None => head,
        };
        state.last.insert(key, at);
        Turn {
            turns: self.clone(),
            level,
            at,
        }
    }
}

impl Turn {
    /// The request was given a call slot: its level's head moves to its turn.
    pub fn granted(&self) {
        let mut state = self.turns.state.lock().unwrap_or_else(|e| e.into_inner());
        let head = state.heads.entry(self.level).or_insert(0);
        *head = (*head).max(self.at);
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        let mut state = self.turns.state.lock().unwrap_or_else(|e| e.into_inner());
        state.held -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn places(turns: &[Turn]) -> Vec<i64> {
        turns.iter().map(|t| t.at).collect()
    }

    #[test]
    fn a_quiet_tenant_goes_next_past_a_busy_tenants_backlog() {
        let turns = Arc::new(Turns::default());
        let busy: Vec<Turn> = (0..5).map(|_| turns.take("busy", 5)).collect();
        assert_eq!(places(&busy), [0, 1, 2, 3, 4]);
        busy[0].granted();
        let quiet = turns.take("quiet", 5);
        assert_eq!(quiet.at, 0, "the next place, before busy's 1 to 4");
        quiet.granted();
        busy[1].granted();
        // Two busy tenants alternate.
        let other: Vec<Turn> = (0..3).map(|_| turns.take("other", 5)).collect();
        assert_eq!(places(&other), [1, 2, 3]);
    }

    #[test]
    fn an_urgent_request_served_first_moves_only_its_own_levels_head() {
        let turns = Arc::new(Turns::default());
        let busy: Vec<Turn> = (0..100).map(|_| turns.take("busy", 5)).collect();
        let urgent: Vec<Turn> = (0..50).map(|_| turns.take("busy", 9)).collect();
        urgent[49].granted();
        let quiet = turns.take("quiet", 5);
        assert_eq!(quiet.at, 0, "still the next place at its level");
        drop((busy, urgent, quiet));
    }

    #[test]
    fn an_idle_lane_starts_its_turns_again() {
        let turns = Arc::new(Turns::default());
        {
            let first = turns.take("a", 5);
            let second = turns.take("a", 5);
            second.granted();
            drop(first);
        }
        assert_eq!(turns.take("a", 5).at, 0);
    }
}
