//! `toolrunner devserver` prints exactly its one stdout line and serves.
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};

struct Kill(Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One raw HTTP/1.1 request; returns (status, body).
fn http(addr: &str, method: &str, path: &str, token: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).expect("connect");
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("write");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read");
    let status = out
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("status line");
    let body = out.split("\r\n\r\n").nth(1).unwrap_or_default().to_owned();
    (status, body)
}

#[test]
fn devserver_prints_its_line_and_serves_the_given_tokens() {
    let child = Command::new(env!("CARGO_BIN_EXE_toolrunner"))
        .args([
            "devserver",
            "--listen",
            "127.0.0.1:0",
            "--token",
            "a=*",
            "--token",
            "b=tools:execute",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn toolrunner");
    let mut child = Kill(child);
    let mut line = String::new();
    BufReader::new(child.0.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("read line");
    let url = line
        .strip_prefix("toolrunner devserver listening on http://")
        .and_then(|rest| rest.strip_suffix('\n'))
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"));
    let (host, port) = url.rsplit_once(':').expect("host:port");
    assert_eq!(host, "127.0.0.1");
    assert!(
        port.parse::<u16>().expect("port") > 0,
        "port 0 must be replaced by the bound port"
    );

    let (status, body) = http(url, "POST", "/v1/agents", "a", r#"{"name":"cli"}"#);
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"agent_id\":\"agt_"), "{body}");
    let (status, body) = http(url, "POST", "/v1/agents", "b", r#"{"name":"cli"}"#);
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("missing_scope"), "{body}");
    let (status, _) = http(url, "POST", "/v1/agents", "dev-admin", r#"{"name":"cli"}"#);
    assert_eq!(status, 401, "given tokens replace the default ones");
}

#[test]
fn devserver_refuses_a_bad_token_spec_with_exit_code_2() {
    let out = Command::new(env!("CARGO_BIN_EXE_toolrunner"))
        .args([
            "devserver",
            "--listen",
            "127.0.0.1:0",
            "--token",
            "a=nonsense:scope",
        ])
        .output()
        .expect("run toolrunner");
    assert_eq!(out.status.code(), Some(2));
    assert!(
        out.stdout.is_empty(),
        "nothing on stdout when it does not listen"
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown scope"));
}
