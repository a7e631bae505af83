//! Transactional admission (issue 30): a waiting head that will not fit is
//! refused before anything reclaimable is evicted, every step it waits. The
//! numbers are worked out by hand below, independent of the scheduler.

use hybridserve_core::scheduler::{RequestParams, Scheduler, SchedulerConfig};

fn step(s: &mut Scheduler, t: &mut f64) {
    *t += 1.0;
    let n: i32 = s.schedule(*t).expect("schedule").num_samples.iter().sum();
    s.update(&vec![9; n as usize]).expect("update");
}

fn params(max_tokens: u32) -> RequestParams {
    RequestParams { max_tokens, ignore_eos: true, ..Default::default() }
}

#[test]
fn refused_head_evicts_nothing() {
    // 28 pages, 4-token blocks, 4 pages per DeltaNet state.
    let mut cfg = SchedulerConfig::new(28, 4, 4, 4, 64, 64);
    cfg.enable_prefix_caching = true;
    let mut s = Scheduler::new(cfg).unwrap();
    let mut t = 0.0;
    // Two 13-token prompts: each leaves a checkpoint after 12 tokens (4 pages)
    // and its blocks parked.
    for (i, base) in [100u32, 200].into_iter().enumerate() {
        s.add_request(&format!("a{i}"), &(base..base + 13).collect::<Vec<_>>(), params(1)).unwrap();
        while s.has_unfinished() {
            step(&mut s, &mut t);
        }
    }
    assert_eq!(s.checkpoints().len(), 2);
    // A 36-token request runs: 9 blocks + 4 state pages = 13 of 28.
    s.add_request("big", &(300..336).collect::<Vec<_>>(), params(20)).unwrap();
    step(&mut s, &mut t);
    let before = s.stats();
    let ck_before = s.checkpoints();
    assert_eq!(ck_before.len(), 2, "the running request fit without evicting a checkpoint");
    // The head needs 12 blocks + 4 state pages = 16 > 28 - 14 (big, growing) = 14
    // pages obtainable even with every checkpoint and parked block evicted.
    s.add_request("head", &(400..448).collect::<Vec<_>>(), params(1)).unwrap();
    for _ in 0..3 {
        step(&mut s, &mut t);
        let st = s.stats();
        assert_eq!(s.num_waiting(), 1, "the head cannot fit");
        assert_eq!(st.last_admission_limit, "pages");
        assert!(st.last_admission_available_pages < 16);
        assert_eq!(s.checkpoints(), ck_before, "a refused admission evicted checkpoints");
        assert_eq!(st.checkpoint_evictions, before.checkpoint_evictions);
        assert_eq!(st.checkpoint_drops, before.checkpoint_drops);
    }
    // Parked blocks go only to the running request's growth (one block per 4
    // decode tokens), never to the refused head.
    let st = s.stats();
    assert!(st.cached_pages + 1 >= before.cached_pages, "cached {} -> {}", before.cached_pages, st.cached_pages);
    // Once big ends the head fits and runs.
    while s.has_unfinished() {
        step(&mut s, &mut t);
    }
}

/// `request_class` comes from clients: past `max_request_classes` distinct
/// values ("default" not counted) every new one is reported as "other".
#[test]
fn request_classes_are_capped() {
    let mut cfg = SchedulerConfig::new(64, 4, 1, 8, 64, 64);
    cfg.max_request_classes = 2;
    let mut s = Scheduler::new(cfg).unwrap();
    let classes = ["default", "a", "b", "c", "a", "d", "b"];
    for (i, c) in classes.iter().enumerate() {
        let p = RequestParams { max_tokens: 1, request_class: c.to_string(), ..Default::default() };
        s.add_request(&format!("r{i}"), &[1, 2, 3], p).unwrap();
    }
    let mut t = 0.0;
    step(&mut s, &mut t);
    let mut got: Vec<(String, String)> = s.take_events().into_iter().map(|e| (e.request_id, e.request_class)).collect();
    got.sort();
    let want: Vec<(String, String)> = ["default", "a", "b", "other", "a", "other", "b"]
        .iter()
        .enumerate()
        .map(|(i, c)| (format!("r{i}"), c.to_string()))
        .collect();
    assert_eq!(got, want);
}
