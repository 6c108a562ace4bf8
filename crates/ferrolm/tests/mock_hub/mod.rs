//! A local mock of the Hugging Face Hub's endpoints that ferrolm uses, on 127.0.0.1: the
//! listing (`/api/models/ORG/REPO/revision/main?blobs=true`), `resolve` (a relative redirect,
//! then an absolute one to a CDN path, with the commit and ETag headers the Hub sends), and the
//! CDN serving byte ranges; tokens, gated and missing repos; and, once armed, a connection cut
//! in the middle of a body.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};

/// The commit every mock repo is at.
pub const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

/// A file of a mock repo.
pub struct MockFile {
    pub name: String,
    pub bytes: Arc<Vec<u8>>,
    /// The sha256 of the bytes.
    pub sha: String,
    /// The sha256 the listing gives (the real one unless a test lies).
    pub listed_sha: String,
}

impl MockFile {
    pub fn new(name: &str, bytes: Vec<u8>) -> MockFile {
        let sha = sha256_hex(&bytes);
        MockFile {
            name: name.to_string(),
            bytes: Arc::new(bytes),
            listed_sha: sha.clone(),
            sha,
        }
    }
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[derive(Default)]
pub struct MockRepo {
    pub files: Vec<MockFile>,
    /// The token a request must carry (a gated repo).
    pub token: Option<String>,
}

struct State {
    repos: HashMap<String, MockRepo>,
    /// Cut the next body longer than one byte halfway.
    cut_next: AtomicBool,
    /// `METHOD PATH range=RANGE` of every request, in order.
    log: Mutex<Vec<String>>,
}

/// A running mock; its thread lives as long as the test process.
pub struct MockHub {
    pub endpoint: String,
    state: Arc<State>,
}

impl MockHub {
    pub fn start(repos: HashMap<String, MockRepo>) -> MockHub {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let state = Arc::new(State {
            repos,
            cut_next: AtomicBool::new(false),
            log: Mutex::new(Vec::new()),
        });
        let st = state.clone();
        let ep = endpoint.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let st = st.clone();
                let ep = ep.clone();
                std::thread::spawn(move || {
                    let _ = serve(conn, &st, &ep);
                });
            }
        });
        MockHub { endpoint, state }
    }

    /// Cut the next file body sent halfway through.
    pub fn cut_next_download(&self) {
        self.state.cut_next.store(true, Ordering::SeqCst);
    }

    pub fn log(&self) -> Vec<String> {
        self.state.log.lock().unwrap().clone()
    }
}

struct Response {
    code: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    /// Send only this many bytes of the body, then close (a cut connection).
    cut_at: Option<usize>,
}

impl Response {
    fn new(code: u16, body: impl Into<Vec<u8>>) -> Response {
        Response {
            code,
            headers: Vec::new(),
            body: body.into(),
            cut_at: None,
        }
    }

    fn header(mut self, k: &str, v: impl Into<String>) -> Response {
        self.headers.push((k.to_string(), v.into()));
        self
    }
}

fn serve(conn: TcpStream, st: &State, endpoint: &str) -> std::io::Result<()> {
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let mut parts = line.split_whitespace();
    let (method, target) = (
        parts.next().unwrap_or("").to_string(),
        parts.next().unwrap_or("").to_string(),
    );
    let mut headers = HashMap::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h)? == 0 || h == "\r\n" || h == "\n" {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    let range = headers.get("range").cloned().unwrap_or_default();
    st.log
        .lock()
        .unwrap()
        .push(format!("{method} {target} range={range}"));
    let resp = route(st, endpoint, &target, &headers);
    write(conn, resp)
}

fn write(mut conn: TcpStream, r: Response) -> std::io::Result<()> {
    let mut head = format!("HTTP/1.1 {} Mock\r\n", r.code);
    for (k, v) in &r.headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str(&format!(
        "Content-Length: {}\r\nConnection: close\r\n\r\n",
        r.body.len()
    ));
    conn.write_all(head.as_bytes())?;
    let n = r.cut_at.unwrap_or(r.body.len());
    conn.write_all(&r.body[..n])?;
    conn.flush()?;
    conn.shutdown(std::net::Shutdown::Both)
}

fn route(st: &State, endpoint: &str, target: &str, headers: &HashMap<String, String>) -> Response {
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let authorized = |repo: &MockRepo| match &repo.token {
        None => true,
        Some(t) => headers.get("authorization") == Some(&format!("Bearer {t}")),
    };
    let refuse = |repo: &MockRepo| {
        let code = if headers.contains_key("authorization") {
            403
        } else {
            401
        };
        let _ = repo;
        Response::new(code, "{\"error\":\"gated\"}").header("X-Error-Code", "GatedRepo")
    };
    let not_found = || {
        Response::new(404, "{\"error\":\"Repository not found\"}")
            .header("X-Error-Code", "RepoNotFound")
    };
    if let Some(rest) = path.strip_prefix("/api/models/") {
        let Some((id, _rev)) = rest.split_once("/revision/") else {
            return not_found();
        };
        let Some(repo) = st.repos.get(id) else {
            return not_found();
        };
        if !authorized(repo) {
            return refuse(repo);
        }
        assert!(query.contains("blobs=true"), "the listing asks for blobs");
        let siblings: Vec<serde_json::Value> = repo
            .files
            .iter()
            .map(|f| {
                serde_json::json!({
                    "rfilename": f.name,
                    "size": f.bytes.len(),
                    "lfs": {"sha256": f.listed_sha, "size": f.bytes.len(), "pointerSize": 134},
                })
            })
            .collect();
        let body = serde_json::json!({"id": id, "sha": COMMIT, "siblings": siblings});
        return Response::new(200, body.to_string()).header("Content-Type", "application/json");
    }
    if let Some(sha) = path.strip_prefix("/cdn/") {
        let Some(file) = st
            .repos
            .values()
            .flat_map(|r| &r.files)
            .find(|f| f.sha == sha)
        else {
            return Response::new(404, "no such blob");
        };
        return ranged(st, file, headers.get("range"));
    }
    // /ORG/REPO/resolve/main/FILE
    let segs: Vec<&str> = path.trim_start_matches('/').splitn(5, '/').collect();
    if segs.len() == 5 && segs[2] == "resolve" {
        let id = format!("{}/{}", segs[0], segs[1]);
        let Some(repo) = st.repos.get(&id) else {
            return not_found();
        };
        if !authorized(repo) {
            return refuse(repo);
        }
        let Some(file) = repo.files.iter().find(|f| f.name == segs[4]) else {
            return Response::new(404, "entry not found").header("X-Error-Code", "EntryNotFound");
        };
        if !query.contains("hop=1") {
            // The Hub answers some resolves with a relative redirect first (renamed repos).
            return Response::new(307, "").header("Location", format!("{path}?hop=1"));
        }
        return Response::new(302, "")
            .header("Location", format!("{endpoint}/cdn/{}", file.sha))
            .header("X-Repo-Commit", COMMIT)
            .header("X-Linked-Etag", format!("\"{}\"", file.listed_sha))
            .header("X-Linked-Size", file.bytes.len().to_string());
    }
    Response::new(404, "unknown endpoint")
}

/// A file's bytes, or the range asked for (`bytes=A-B` or `bytes=A-`).
fn ranged(st: &State, file: &MockFile, range: Option<&String>) -> Response {
    let bytes = &file.bytes;
    let len = bytes.len();
    let (start, end) = match range.and_then(|r| r.strip_prefix("bytes=")) {
        None => (0, len),
        Some(spec) => {
            let (a, b) = spec.split_once('-').unwrap_or((spec, ""));
            let a: usize = a.parse().unwrap_or(0);
            let b: usize = b.parse().map(|b: usize| b + 1).unwrap_or(len).min(len);
            if a >= len || a >= b {
                return Response::new(416, "").header("Content-Range", format!("bytes */{len}"));
            }
            (a, b)
        }
    };
    let mut r = Response::new(
        if range.is_some() { 206 } else { 200 },
        bytes[start..end].to_vec(),
    )
    .header("ETag", format!("\"{}\"", file.sha));
    if range.is_some() {
        r = r.header("Content-Range", format!("bytes {start}-{}/{len}", end - 1));
    }
    if end - start > 1 && st.cut_next.swap(false, Ordering::SeqCst) {
        r.cut_at = Some((end - start) / 2);
    }
    r
}
