//! TLS between the driver and its workers, and between workers (a grouping's shuffle):
//! three `weir worker --tls-cert --tls-key --tls-ca` processes listed as `https://` give
//! the single process's result; a driver without the CA, with another CA, or dialling
//! `http://` is refused before batch 0, naming the worker.

use std::path::{Path, PathBuf};
use std::process::Command;

use weir_testkit::{run_weir, temp_dir};

use crate::bin;
use crate::cluster::{Worker, cluster_pipeline, on_workers_and_alone, refs};

/// Runs openssl with `args` in `dir`; it must succeed.
fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("running openssl");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CA named `ca` in `dir` (`<ca>.pem`, `<ca>.key`) and, signed by it, a certificate for
/// 127.0.0.1 and `weir-workers` (`<ca>-worker.pem`, `<ca>-worker.key`).
fn ca_and_worker_cert(dir: &Path, ca: &str) -> [PathBuf; 3] {
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
    ];
    let (ca_pem, ca_key) = (format!("{ca}.pem"), format!("{ca}.key"));
    let (w_pem, w_key, w_csr) = (
        format!("{ca}-worker.pem"),
        format!("{ca}-worker.key"),
        format!("{ca}-worker.csr"),
    );
    let mut args = vec!["req", "-x509", "-days", "2", "-subj", "/CN=weir test CA"];
    args.extend(ec);
    args.extend(["-keyout", &ca_key, "-out", &ca_pem]);
    openssl(dir, &args);
    let mut args = vec!["req", "-subj", "/CN=weir worker"];
    args.extend(ec);
    args.extend(["-keyout", &w_key, "-out", &w_csr]);
    openssl(dir, &args);
    std::fs::write(
        dir.join("san.ext"),
        "subjectAltName=IP:127.0.0.1,DNS:weir-workers\n",
    )
    .unwrap();
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-days",
            "2",
            "-in",
            &w_csr,
            "-CA",
            &ca_pem,
            "-CAkey",
            &ca_key,
            "-CAcreateserial",
            "-extfile",
            "san.ext",
            "-out",
            &w_pem,
        ],
    );
    [dir.join(ca_pem), dir.join(w_pem), dir.join(w_key)]
}

fn tls_worker(cert: &Path, key: &Path, ca: &Path) -> Worker {
    let mut cmd = Command::new(bin());
    cmd.args(["worker", "--listen", "127.0.0.1:0", "--token", "t0k"])
        .arg("--tls-cert")
        .arg(cert)
        .arg("--tls-key")
        .arg(key)
        .arg("--tls-ca")
        .arg(ca);
    Worker::spawn(cmd)
}

#[tokio::test]
async fn a_shuffle_between_tls_workers_equals_a_single_process_run_and_wrong_trust_is_refused() {
    let certs = temp_dir();
    let [ca, cert, key] = ca_and_worker_cert(certs.path(), "ca");
    let ws = [0, 1, 2].map(|_| tls_worker(&cert, &key, &ca));
    for w in &ws {
        assert!(w.url.starts_with("https://127.0.0.1:"), "{}", w.url);
    }
    let sql = "SELECT status, count(*) AS n, sum(order_id) AS s, min(updated_at) AS first \
               FROM batch GROUP BY status";
    let extra = format!("token = \"t0k\"\ntls-ca = \"{}\"", ca.display());
    let [cluster, alone] =
        on_workers_and_alone(&refs(&ws), &extra, sql, 100, &["status", "n", "s", "first"]).await;
    assert_eq!(
        cluster, alone,
        "the TLS cluster's groups are the single process's"
    );

    // Refused before batch 0, naming the worker: another CA; the worker dialled as http://;
    // no CA at all (by `weir check`, naming the setting).
    let dir = temp_dir();
    crate::gen_orders(&dir.path().join("in"), 2, 10, 5);
    let [other_ca, _, _] = ca_and_worker_cert(certs.path(), "other");
    let w = &ws[0];
    let plain = w.url.replacen("https://", "http://", 1);
    for (extra, url, says) in [
        (
            format!("token = \"t0k\"\ntls-ca = \"{}\"", other_ca.display()),
            w.url.clone(),
            "certificate",
        ),
        ("token = \"t0k\"".to_string(), plain.clone(), &plain[..]),
    ] {
        let p = cluster_pipeline(dir.path(), &[w], &extra, 1);
        let text = std::fs::read_to_string(&p).unwrap().replace(&w.url, &url);
        std::fs::write(&p, text).unwrap();
        let out = run_weir(&bin(), &["run", p.to_str().unwrap()], None);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{extra}: {stderr}");
        assert!(
            stderr.contains("no usable worker") && stderr.contains(&url),
            "{extra}: {stderr}"
        );
        assert!(stderr.contains(says), "{extra}: {stderr}");
        assert!(!dir.path().join("chk/offsets/0").exists());
    }
    let p = cluster_pipeline(dir.path(), &[w], "token = \"t0k\"", 1);
    let out = run_weir(&bin(), &["check", p.to_str().unwrap()], None);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("cluster.tls-ca"),
        "{stderr}"
    );
}
