//! What graphs and execs keep alive: the [`Resource`] alias and the set that holds each once.

use std::any::Any;
use std::collections::HashSet;
use std::sync::Arc;

/// Something a graph's nodes use (a device allocation, a module, a child graph's resources)
/// and must keep alive for as long as the graph, or an exec made from it, may run.
pub type Resource = Arc<dyn Any + Send + Sync>;

/// Resources kept alive, each once (compared by address), in insertion order.
///
/// A captured chain of 1000 launches over one buffer registers that buffer and its module
/// 1000 times; keeping each once makes exec updates and per-node setters cost O(new
/// resources), not O(everything held).
#[derive(Debug, Default, Clone)]
pub(crate) struct ResourceSet {
    list: Vec<Resource>,
    seen: HashSet<usize>,
}

impl ResourceSet {
    /// Adds `r` unless it is already held.
    pub(crate) fn insert(&mut self, r: Resource) {
        if self.seen.insert(Arc::as_ptr(&r) as *const () as usize) {
            self.list.push(r);
        }
    }

    /// Adds each of `more` not already held.
    pub(crate) fn extend(&mut self, more: impl IntoIterator<Item = Resource>) {
        for r in more {
            self.insert(r);
        }
    }

    /// Whether nothing is held.
    pub(crate) fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// The resources, each once.
    pub(crate) fn into_vec(self) -> Vec<Resource> {
        self.list
    }

    /// Everything held.
    pub(crate) fn as_slice(&self) -> &[Resource] {
        &self.list
    }
}

impl FromIterator<Resource> for ResourceSet {
    fn from_iter<I: IntoIterator<Item = Resource>>(iter: I) -> ResourceSet {
        let mut set = ResourceSet::default();
        set.extend(iter);
        set
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_resource_is_kept_once_in_order() {
        let a: Resource = Arc::new(1u32);
        let b: Resource = Arc::new(2u32);
        let mut set = ResourceSet::default();
        set.extend([a.clone(), b.clone(), a.clone(), a.clone(), b.clone()]);
        assert_eq!(set.as_slice().len(), 2);
        assert!(Arc::ptr_eq(&set.as_slice()[0], &a));
        assert!(Arc::ptr_eq(&set.as_slice()[1], &b));
        // The set holds one strong count of each.
        assert_eq!(Arc::strong_count(&a), 2);
    }
}
