//! The signal that ends every open event stream once the daemon has
//! drained.
//!
//! Each stream looks at it whenever it has no event ready, which at W =
//! 10,000 watchers is 10,000 looks per event. A `CancellationToken` costs
//! two mutex round trips per look (its tree node's, then its `Notify`'s
//! waiter list); here a look is an atomic load and a lock-free waker
//! registration. The one lock is taken when a stream starts and ends.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use futures_util::task::AtomicWaker;

/// Cloned into every service that opens event streams; [`StreamsEnd::end`]
/// is called once, when the daemon has drained.
#[derive(Clone, Default)]
pub struct StreamsEnd(Arc<Shared>);

#[derive(Default)]
struct Shared {
    ended: AtomicBool,
    /// The waker of each listening stream, by its key.
    listening: Mutex<Listening>,
}

#[derive(Default)]
struct Listening {
    next: u64,
    wakers: HashMap<u64, Arc<AtomicWaker>>,
}

impl StreamsEnd {
    /// Ends every stream: the ones listening now are woken, and any made
    /// later is ended from its first look.
    pub fn end(&self) {
        self.0.ended.store(true, Ordering::SeqCst);
        let listening = self.0.listening.lock().unwrap_or_else(PoisonError::into_inner);
        for waker in listening.wakers.values() {
            waker.wake();
        }
    }

    /// A stream's own view of the signal, until it is dropped.
    pub fn listen(&self) -> Listener {
        let waker = Arc::new(AtomicWaker::new());
        let mut listening = self.0.listening.lock().unwrap_or_else(PoisonError::into_inner);
        let key = listening.next;
        listening.next += 1;
        listening.wakers.insert(key, waker.clone());
        drop(listening);
        Listener { shared: self.0.clone(), key, waker }
    }

    #[cfg(test)]
    fn listeners(&self) -> usize {
        self.0.listening.lock().unwrap().wakers.len()
    }
}

/// One stream's listener: ready once the streams have been ended.
pub struct Listener {
    shared: Arc<Shared>,
    key: u64,
    waker: Arc<AtomicWaker>,
}

impl Listener {
    /// Ready once [`StreamsEnd::end`] was called; otherwise the task of
    /// `cx` is woken when it is.
    pub fn poll_ended(&self, cx: &mut Context<'_>) -> Poll<()> {
        if self.shared.ended.load(Ordering::SeqCst) {
            return Poll::Ready(());
        }
        self.waker.register(cx.waker());
        // `end` may have set the flag and woken the wakers between the
        // first load and the registration: look again.
        if self.shared.ended.load(Ordering::SeqCst) {
            return Poll::Ready(());
        }
        Poll::Pending
    }

    /// [`Listener::poll_ended`] as a future.
    pub async fn ended(&self) {
        std::future::poll_fn(|cx| self.poll_ended(cx)).await
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        let mut listening = self.shared.listening.lock().unwrap_or_else(PoisonError::into_inner);
        listening.wakers.remove(&self.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::task::{Wake, Waker};

    /// A waker that counts its wakes.
    struct Counted(AtomicUsize);

    impl Wake for Counted {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn counted() -> (Arc<Counted>, Waker) {
        let counter = Arc::new(Counted(AtomicUsize::new(0)));
        (counter.clone(), Waker::from(counter))
    }

    #[test]
    fn a_listening_stream_is_woken_once_and_then_ready() {
        let end = StreamsEnd::default();
        let listener = end.listen();
        let (count, waker) = counted();
        let mut cx = Context::from_waker(&waker);
        assert!(listener.poll_ended(&mut cx).is_pending());
        assert!(listener.poll_ended(&mut cx).is_pending(), "a second look registers the same waker again");
        assert_eq!(count.0.load(Ordering::SeqCst), 0);
        end.end();
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
        assert!(listener.poll_ended(&mut cx).is_ready());
    }

    #[test]
    fn the_last_waker_a_stream_looked_with_is_the_one_woken() {
        let end = StreamsEnd::default();
        let listener = end.listen();
        let (first, first_waker) = counted();
        let (second, second_waker) = counted();
        assert!(listener.poll_ended(&mut Context::from_waker(&first_waker)).is_pending());
        assert!(listener.poll_ended(&mut Context::from_waker(&second_waker)).is_pending());
        end.end();
        assert_eq!((first.0.load(Ordering::SeqCst), second.0.load(Ordering::SeqCst)), (0, 1));
    }

    #[test]
    fn a_stream_made_after_the_end_is_ended_at_its_first_look() {
        let end = StreamsEnd::default();
        end.end();
        let listener = end.clone().listen();
        let (count, waker) = counted();
        assert!(listener.poll_ended(&mut Context::from_waker(&waker)).is_ready());
        assert_eq!(count.0.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_stream_that_ends_leaves_no_waker_behind() {
        let end = StreamsEnd::default();
        let (a, b) = (end.listen(), end.listen());
        assert_eq!(end.listeners(), 2);
        drop(a);
        assert_eq!(end.listeners(), 1);
        end.end();
        drop(b);
        assert_eq!(end.listeners(), 0);
    }
}
