//! Findings of a review of the development platform against the protocol:
//! each test failed before its fix, for the reason named in its comment.

use std::time::Duration;

use futures_util::StreamExt;
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use toolrunner_devserver::DevServer;

const ADMIN: &str = "dev-admin";
const EXEC: &str = "dev-executor";

struct T {
    _server: DevServer,
    base: String,
    http: toolrunner::platform::Platform,
    binding: String,
    version: String,
}

struct R {
    status: u16,
    text: String,
    json: Value,
}

impl R {
    fn code(&self) -> &str {
        self.json["error"]["code"].as_str().unwrap_or("")
    }
}

impl T {
    async fn start() -> T {
        T::start_with(DevServer::builder()).await
    }

    async fn start_with(b: toolrunner_devserver::DevServerBuilder) -> T {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let server = b
            .listen("127.0.0.1:0".parse().unwrap())
            .start()
            .await
            .expect("server");
        let base = format!("{}/v1", server.base_url());
        let http = crate::common::api(&server.base_url());
        let mut t = T {
            _server: server,
            base,
            http,
            binding: String::new(),
            version: String::new(),
        };
        let agent = t.post(ADMIN, "/agents", json!({"name": "a"})).await.json["agent_id"]
            .as_str()
            .unwrap()
            .to_owned();
        let binding = t
            .post(
                ADMIN,
                "/executor-bindings",
                json!({"agent_id": agent, "name": "b", "tool_names": ["t.read"]}),
            )
            .await
            .json["binding_id"]
            .as_str()
            .unwrap()
            .to_owned();
        let version = t
            .post(
                ADMIN,
                &format!("/agents/{agent}/versions"),
                json!({"tools": [{"name": "t.read", "description": "d", "binding_id": binding,
                                   "input_schema": {"type": "object"}}]}),
            )
            .await
            .json["agent_version"]
            .as_str()
            .unwrap()
            .to_owned();
        t.binding = binding;
        t.version = version;
        t
    }

    async fn raw(
        &self,
        method: toolrunner::platform::Method,
        token: &str,
        path: &str,
        body: Option<Vec<u8>>,
        grant: Option<&str>,
    ) -> Result<R, toolrunner::Error> {
        let mut rb = self
            .http
            .request(method, path)
            .token(Some(token))
            .header("content-type", "application/json");
        if let Some(g) = grant {
            rb = rb.header("tool-grant", g);
        }
        if let Some(b) = body {
            rb = rb.body(b);
        }
        let resp = rb.send().await?;
        let text = String::from_utf8_lossy(&resp.body).into_owned();
        let json = resp.json();
        Ok(R {
            status: resp.status,
            text,
            json,
        })
    }

    async fn post(&self, token: &str, path: &str, body: Value) -> R {
        self.raw(
            toolrunner::platform::Method::POST,
            token,
            path,
            Some(serde_json::to_vec(&body).unwrap()),
            None,
        )
        .await
        .expect("transport")
    }

    async fn get(&self, token: &str, path: &str) -> R {
        self.raw(toolrunner::platform::Method::GET, token, path, None, None)
            .await
            .expect("transport")
    }

    async fn run(&self) -> (String, String) {
        let r = self
            .post(
                ADMIN,
                "/runs",
                json!({"agent_version": self.version, "subject": "u",
                       "tool_calls": [{"tool_name": "t.read", "arguments": {}}]}),
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.text);
        (
            r.json["run_id"].as_str().unwrap().to_owned(),
            r.json["tool_calls"][0]["call_id"]
                .as_str()
                .unwrap()
                .to_owned(),
        )
    }

    async fn connect(&self, exe: &str, instance: &str) -> String {
        let r = self
            .post(
                EXEC,
                "/executors/connect",
                json!({"executor_id": exe, "instance_id": instance, "binding_id": self.binding,
                       "tools": ["t.read"], "capacity": 8}),
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.text);
        r.json["connection_id"].as_str().unwrap().to_owned()
    }

    /// Claims and returns `(assignment_id, grant)`.
    async fn claim(&self, run: &str, call: &str, exe: &str, con: &str) -> (String, String) {
        let r = self
            .post(
                EXEC,
                &format!("/runs/{run}/tool-calls/{call}/claim"),
                json!({"executor_id": exe, "connection_id": con, "operation_key": "k1"}),
            )
            .await;
        assert_eq!(r.status, 200, "{}", r.text);
        let a = &r.json["assignment"];
        (
            a["assignment_id"].as_str().unwrap().to_owned(),
            a["grant"].as_str().unwrap().to_owned(),
        )
    }

    async fn receipt_raw(&self, run: &str, call: &str, grant: &str, body: &[u8]) -> R {
        self.raw(
            toolrunner::platform::Method::POST,
            EXEC,
            &format!("/runs/{run}/tool-calls/{call}/receipts"),
            Some(body.to_vec()),
            Some(grant),
        )
        .await
        .expect("transport")
    }

    async fn open_stream(
        &self,
        exe: &str,
        con: &str,
    ) -> tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>
    {
        let url = format!(
            "{}/executors/{exe}/stream?connection_id={con}",
            self.base.replacen("http://", "ws://", 1)
        );
        let mut req = url.into_client_request().unwrap();
        req.headers_mut()
            .insert("authorization", format!("Bearer {EXEC}").parse().unwrap());
        tokio_tungstenite::connect_async(req).await.expect("ws").0
    }
}

/// Next non-ping text frame within `ms`.
async fn next_frame(
    ws: &mut tokio_tungstenite::WebSocketStream<
        tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>,
    >,
    ms: u64,
) -> Option<Value> {
    let end = tokio::time::Instant::now() + Duration::from_millis(ms);
    loop {
        match tokio::time::timeout_at(end, ws.next()).await {
            Err(_) | Ok(None) | Ok(Some(Err(_))) => return None,
            Ok(Some(Ok(Message::Text(t)))) => {
                let v: Value = serde_json::from_str(t.as_str()).unwrap();
                if v["type"] != "ping" {
                    return Some(v);
                }
            }
            Ok(Some(Ok(Message::Close(_)))) => return None,
            Ok(Some(Ok(_))) => {}
        }
    }
}

// ---------------------------------------------------------------------------
// F1: a pending cursor the platform never issued makes the handler overflow
// (`s + 1` on u64::MAX in executor.rs pending_page): in debug builds the
// request panics and the connection is closed without an answer; in release
// it wraps to the first page. Choices 20: "a malformed cursor is 400
// invalid_cursor"; §1: every response carries x-request-id and the envelope.
#[tokio::test]
async fn pending_cursor_at_u64_max_is_400_invalid_cursor_not_a_panic() {
    let t = T::start().await;
    let con = t.connect("exe_a", "i1").await;
    let r = t
        .raw(
            toolrunner::platform::Method::GET,
            EXEC,
            &format!(
                "/executors/exe_a/pending?connection_id={con}&cursor=cur_18446744073709551615"
            ),
            None,
            None,
        )
        .await;
    let r = r.expect("the platform must answer, not drop the connection");
    assert_eq!(r.status, 400, "{}", r.text);
    assert_eq!(r.code(), "invalid_cursor", "{}", r.text);
}

// ---------------------------------------------------------------------------
// F2: heartbeat `in_flight` items ignore unlisted fields (CallRef has no
// deny_unknown_fields). §1: "Fields not listed for a request must be absent
// (400, code unknown_field)".
#[tokio::test]
async fn heartbeat_in_flight_item_with_unlisted_field_is_400_unknown_field() {
    let t = T::start().await;
    let con = t.connect("exe_a", "i1").await;
    let r = t
        .post(
            EXEC,
            "/executors/exe_a/heartbeat",
            json!({"connection_id": con,
                   "in_flight": [{"run_id": "run_x", "call_id": "call_x", "bogus": 1}]}),
        )
        .await;
    assert_eq!(r.status, 400, "{}", r.text);
    assert_eq!(r.code(), "unknown_field", "{}", r.text);
}

// ---------------------------------------------------------------------------
// F3: POST /runs/{unknown}/cancel judges the body before finding the run.
// §1 "404 is only for resources named in the path"; choices 27: a body is
// judged "after the resources named in the path are found (404 ...)".
#[tokio::test]
async fn cancel_of_unknown_run_is_404_before_the_body_is_judged() {
    let t = T::start().await;
    let r = t
        .post(
            ADMIN,
            "/runs/run_0000000000000000000000000000dead/cancel",
            json!({"x": 1}),
        )
        .await;
    assert_eq!(r.status, 404, "{}", r.text);
    assert_eq!(r.code(), "unknown_run", "{}", r.text);
}

// ---------------------------------------------------------------------------
// F4: a stored receipt's `body` loses the request's leading/trailing
// whitespace (RawValue::from_string in runs.rs `stored`). §5: "Receipt bodies
// are stored byte-for-byte"; choices 42: "a stored receipt's body is the
// request body byte for byte".
#[tokio::test]
async fn stored_receipt_body_keeps_every_byte_of_the_value() {
    let t = T::start().await;
    let (run, call) = t.run().await;
    let con = t.connect("exe_a", "i1").await;
    let (asg, grant) = t.claim(&run, &call, "exe_a", &con).await;
    let body = format!(
        "\n  {{\"receipt_id\": \"r0\", \"executor_id\": \"exe_a\", \"assignment_id\": \"{asg}\", \"sequence\": 0, \"kind\": \"accepted\"}}  \n"
    );
    let r = t.receipt_raw(&run, &call, &grant, body.as_bytes()).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let got = t.get(ADMIN, &format!("/runs/{run}")).await;
    // The run object is JSON and embeds the stored body as JSON: every byte
    // of the value (spacing, key order) is kept; only the whitespace around
    // the value cannot be embedded (docs/protocol.md choice 42).
    let inner = body.trim();
    assert!(
        got.text.contains(inner),
        "the body's bytes are kept: {}",
        got.text
    );
}

// ---------------------------------------------------------------------------
// F5: a late receipt re-sent under the same receipt_id with a different body
// is appended to late_receipts a second time (receipts.rs dedups on
// id+canonical only). §5 table: "same receipt_id, different body -> 409
// receipt_conflict" comes before run_terminated; receipt_id is "unique within
// the call". The audit trail ends up with two different bodies for one id.
#[tokio::test]
async fn late_receipt_same_id_different_body_is_receipt_conflict_and_not_stored_twice() {
    let t = T::start().await;
    let (run, call) = t.run().await;
    let con = t.connect("exe_a", "i1").await;
    let (asg, grant) = t.claim(&run, &call, "exe_a", &con).await;
    let acc = json!({"receipt_id": "r0", "executor_id": "exe_a", "assignment_id": asg,
                     "sequence": 0, "kind": "accepted"});
    let r = t
        .receipt_raw(&run, &call, &grant, &serde_json::to_vec(&acc).unwrap())
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let r = t
        .post(ADMIN, &format!("/runs/{run}/cancel"), json!({}))
        .await;
    assert_eq!(r.status, 200, "{}", r.text);
    let late = |v: u32| {
        json!({"receipt_id": "r1", "executor_id": "exe_a", "assignment_id": asg,
               "sequence": 1, "kind": "completed", "result": {"v": v}})
    };
    let r = t
        .receipt_raw(&run, &call, &grant, &serde_json::to_vec(&late(1)).unwrap())
        .await;
    assert_eq!(r.code(), "run_terminated", "{}", r.text);
    let r = t
        .receipt_raw(&run, &call, &grant, &serde_json::to_vec(&late(2)).unwrap())
        .await;
    let got = t.get(ADMIN, &format!("/runs/{run}")).await;
    let kept = got.json["tool_calls"][0]["late_receipts"]
        .as_array()
        .unwrap()
        .len();
    assert_eq!(
        (r.code(), kept),
        ("receipt_conflict", 1),
        "second late body under the same receipt_id: {} ; late_receipts: {}",
        r.text,
        got.json["tool_calls"][0]["late_receipts"]
    );
}

// ---------------------------------------------------------------------------
// F6: a superseded connection's stream keeps receiving frames (call.pending
// filtered by the *new* connection's tools) until the next ping tick, which
// is heartbeat_interval_ms (default 5 s). §4: a new connect "supersedes the
// previous connection at once"; choices 33: "a stream closes when its
// connection stops being live".
#[tokio::test]
async fn superseded_connections_stream_gets_no_more_frames() {
    let t = T::start().await;
    let c1 = t.connect("exe_a", "inst_old").await;
    let mut ws_old = t.open_stream("exe_a", &c1).await;
    // Let the first ping tick pass (it fires at once).
    tokio::time::sleep(Duration::from_millis(200)).await;
    let _c2 = t.connect("exe_a", "inst_new").await;
    let (_run, call) = t.run().await;
    let frame = next_frame(&mut ws_old, 1500).await;
    assert!(
        frame.is_none(),
        "the superseded connection's stream still got {frame:?} (call {call})"
    );
}

// ---------------------------------------------------------------------------
// F7: an `accepted` receipt carrying `"error": null` (a field listed only for
// `failed`) is accepted and stored: `null` is read as "absent" for
// progress/error/reason. §5 kinds table: accepted has "none" extra fields;
// §1: "Fields not listed for a request must be absent (400, unknown_field)".
#[tokio::test]
async fn accepted_receipt_with_error_null_is_400_unknown_field() {
    let t = T::start().await;
    let (run, call) = t.run().await;
    let con = t.connect("exe_a", "i1").await;
    let (asg, grant) = t.claim(&run, &call, "exe_a", &con).await;
    let body = json!({"receipt_id": "r0", "executor_id": "exe_a", "assignment_id": asg,
                      "sequence": 0, "kind": "accepted", "error": null});
    let r = t
        .receipt_raw(&run, &call, &grant, &serde_json::to_vec(&body).unwrap())
        .await;
    assert_eq!((r.status, r.code()), (400, "unknown_field"), "{}", r.text);
}
