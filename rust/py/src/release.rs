//! The Python objects that keep a transfer's memory alive are let go by the I/O thread that
//! ends the transfer, without the GIL. PyO3 would queue them under a process-wide mutex, which
//! a fork() child inherits locked if an I/O thread held it at the fork (a DataLoader worker
//! would hang in its first call). They go on a lock-free stack instead, emptied with the GIL.

use pyo3::prelude::*;
use std::ptr;
use std::sync::atomic::{AtomicPtr, Ordering};

struct Node {
    obj: Py<PyAny>,
    next: *mut Node,
}

static HEAD: AtomicPtr<Node> = AtomicPtr::new(ptr::null_mut());

/// A transfer's owner (`core::Owner`): let go onto the stack, whichever thread drops it.
pub struct PyOwner(Option<Py<PyAny>>);

impl PyOwner {
    pub fn new(obj: Py<PyAny>) -> Box<Self> {
        Box::new(PyOwner(Some(obj)))
    }
}

impl Drop for PyOwner {
    fn drop(&mut self) {
        let Some(obj) = self.0.take() else { return };
        let node = Box::into_raw(Box::new(Node { obj, next: ptr::null_mut() }));
        let mut head = HEAD.load(Ordering::Relaxed);
        loop {
            // Safety: the node is ours until the exchange below publishes it.
            unsafe { (*node).next = head };
            // One exchange links it: a thread that vanishes in a fork leaves the stack whole.
            match HEAD.compare_exchange_weak(head, node, Ordering::Release, Ordering::Relaxed) {
                Ok(_) => return,
                Err(now) => head = now,
            }
        }
    }
}

/// Drop the owners let go so far (their references go at once: the GIL is held).
pub fn drain(_py: Python<'_>) {
    if HEAD.load(Ordering::Relaxed).is_null() {
        return;
    }
    let mut p = HEAD.swap(ptr::null_mut(), Ordering::Acquire);
    while !p.is_null() {
        // Safety: every node was made by Box::into_raw in `drop` and is taken here once.
        let Node { obj, next } = *unsafe { Box::from_raw(p) };
        drop(obj);
        p = next;
    }
}
