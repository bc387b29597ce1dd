//! The bare protocol loop: the requests the executor makes for one call,
//! and nothing else.

use super::*;

/// The bare protocol: one executor identity, `capacity` calls at a time,
/// each `pending` → claim → `accepted` → `completed`; no store.
pub(crate) async fn bare(
    base: &str,
    binding_id: &str,
    calls: usize,
    capacity: u32,
) -> Result<Side> {
    let api = Platform::new(base, EXEC)?;
    let executor_id = "bench-bare";
    let connected = api
        .request(toolrunner::platform::Method::POST, "/executors/connect")
        .json(
            &json!({"executor_id": executor_id, "binding_id": binding_id,
            "tools": ["bench.noop"], "capacity": capacity}),
        )
        .send()
        .await?
        .json();
    let connection_id = connected["connection_id"]
        .as_str()
        .with_context(|| format!("connect answered {connected}"))?
        .to_owned();
    let heartbeat = {
        let (api, connection_id) = (api.clone(), connection_id.clone());
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(2)).await;
                let _ = api
                    .request(
                        toolrunner::platform::Method::POST,
                        &format!("/executors/{executor_id}/heartbeat"),
                    )
                    .json(&json!({"connection_id": connection_id, "in_flight": []}))
                    .send()
                    .await;
            }
        })
    };
    let slots = Arc::new(Semaphore::new(capacity as usize));
    let in_flight = Arc::new(Mutex::new(HashSet::<String>::new()));
    let latencies = Arc::new(Mutex::new(Vec::with_capacity(calls)));
    let freed = Arc::new(Notify::new());
    let cpu = cpu_time()?;
    let started = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    let mut claimed = 0;
    while claimed < calls {
        let free = slots.available_permits();
        if free == 0 {
            freed.notified().await;
            continue;
        }
        let path = format!(
            "/executors/{executor_id}/pending?connection_id={connection_id}&limit={}",
            free.min(100)
        );
        let page = api
            .request(toolrunner::platform::Method::GET, &path)
            .send()
            .await?
            .json();
        let data = page["data"]
            .as_array()
            .with_context(|| format!("pending answered {page}"))?;
        let mut any = false;
        for c in data {
            let run_id = c["run_id"].as_str().context("run_id")?.to_owned();
            let call_id = c["call_id"].as_str().context("call_id")?.to_owned();
            if !in_flight.lock().expect("lock").insert(call_id.clone()) {
                continue;
            }
            let Ok(permit) = slots.clone().try_acquire_owned() else {
                in_flight.lock().expect("lock").remove(&call_id);
                break;
            };
            any = true;
            claimed += 1;
            let (api, connection_id, latencies, freed) = (
                api.clone(),
                connection_id.clone(),
                latencies.clone(),
                freed.clone(),
            );
            workers.spawn(async move {
                let t = Instant::now();
                let result = one_call(&api, executor_id, &connection_id, &run_id, &call_id).await;
                latencies.lock().expect("lock").push(t.elapsed());
                drop(permit);
                freed.notify_one();
                result
            });
        }
        if !any {
            tokio::select! {
                _ = freed.notified() => {}
                _ = tokio::time::sleep(Duration::from_millis(5)) => {}
            }
        }
        while let Some(done) = workers.try_join_next() {
            done??;
        }
    }
    while let Some(done) = workers.join_next().await {
        done??;
    }
    let elapsed = started.elapsed();
    let cpu = cpu_time()? - cpu;
    heartbeat.abort();
    let latencies = std::mem::take(&mut *latencies.lock().expect("lock"));
    Ok(Side {
        calls,
        elapsed,
        latencies,
        cpu,
    })
}
