//! A TCP proxy that delays every byte by a fixed time in each direction: added network
//! latency between processes on this machine where the kernel has no `netem` (the
//! latency-only part of `tc qdisc ... netem delay`; throughput is not limited).

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// A proxy listening on [`DelayProxy::addr`], forwarding each connection to its target
/// with `delay` added each way. Stops accepting when dropped (open connections run on until
/// either end closes).
pub struct DelayProxy {
    pub addr: SocketAddr,
    bytes: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

impl DelayProxy {
    /// Listens on `listen` (`10.0.0.1:0`: a free port) and forwards to `target`
    /// (`host:port`), connecting to it afresh for each connection (a target restarted on
    /// the same address is found again).
    pub fn start(listen: &str, target: &str, delay: Duration) -> std::io::Result<DelayProxy> {
        let listener = TcpListener::bind(listen)?;
        let addr = listener.local_addr()?;
        let bytes = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (counted, stopped, target) = (bytes.clone(), stop.clone(), target.to_string());
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if stopped.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(down) = conn else { continue };
                let (target, counted) = (target.clone(), counted.clone());
                std::thread::spawn(move || {
                    // A target that is down: the client sees its connection closed.
                    let Ok(up) = TcpStream::connect(&target) else {
                        return;
                    };
                    let _ = (down.set_nodelay(true), up.set_nodelay(true));
                    if let (Ok(d), Ok(u)) = (down.try_clone(), up.try_clone()) {
                        pipe(d, u, delay, counted.clone());
                        pipe(up, down, delay, counted);
                    }
                });
            }
        });
        Ok(DelayProxy { addr, bytes, stop })
    }

    /// Bytes forwarded so far, both ways, over every connection.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::SeqCst)
    }
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the accept loop so that it sees the stop.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
    }
}

/// Copies `from` to `to`, each read written `delay` after it arrived (in order). The end
/// of `from` ends `to`'s writing; an error on either side closes both.
fn pipe(mut from: TcpStream, mut to: TcpStream, delay: Duration, counted: Arc<AtomicU64>) {
    let (tx, rx) = mpsc::channel::<(Instant, Vec<u8>)>();
    let reader = from.try_clone();
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match from.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    counted.fetch_add(n as u64, Ordering::SeqCst);
                    if tx
                        .send((Instant::now() + delay, buf[..n].to_vec()))
                        .is_err()
                    {
                        break;
                    }
                }
                Err(_) => {
                    let _ = from.shutdown(Shutdown::Both);
                    break;
                }
            }
        }
    });
    std::thread::spawn(move || {
        for (due, bytes) in rx {
            std::thread::sleep(due.saturating_duration_since(Instant::now()));
            if to.write_all(&bytes).is_err() {
                let _ = to.shutdown(Shutdown::Both);
                if let Ok(r) = &reader {
                    let _ = r.shutdown(Shutdown::Both);
                }
                return;
            }
        }
        // `from` ended: so does what this side writes.
        let _ = to.shutdown(Shutdown::Write);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An echo server behind the proxy: what is sent comes back whole, in order, and no
    /// sooner than twice the delay.
    #[test]
    fn bytes_come_back_whole_and_late() {
        let echo = TcpListener::bind("127.0.0.1:0").unwrap();
        let target = echo.local_addr().unwrap().to_string();
        std::thread::spawn(move || {
            for conn in echo.incoming() {
                let mut s = conn.unwrap();
                std::thread::spawn(move || {
                    let mut r = s.try_clone().unwrap();
                    let _ = std::io::copy(&mut r, &mut s);
                });
            }
        });
        let proxy = DelayProxy::start("127.0.0.1:0", &target, Duration::from_millis(30)).unwrap();
        let mut c = TcpStream::connect(proxy.addr).unwrap();
        let sent: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let started = Instant::now();
        let mut w = c.try_clone().unwrap();
        let out = sent.clone();
        let writer = std::thread::spawn(move || {
            w.write_all(&out).unwrap();
            w.shutdown(Shutdown::Write).unwrap();
        });
        let mut got = Vec::new();
        c.read_to_end(&mut got).unwrap();
        writer.join().unwrap();
        assert!(got == sent, "{} bytes back of {}", got.len(), sent.len());
        assert!(started.elapsed() >= Duration::from_millis(60));
        assert_eq!(proxy.bytes(), 2 * sent.len() as u64);
    }
}
