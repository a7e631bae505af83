//! Aging bounds how long an urgent stream can hold back a low-priority request.

use hybridserve_core::scheduler::{PreemptCause, RequestParams, Scheduler, SchedulerConfig};

/// The starvation bound of the module docs, under a stream of urgent arrivals
/// (one priority-0 request per step from step 1, each 1 prefill step + 2
/// decodes) against one priority-3 request X arriving at step 0 and running at
/// once, with one sequence of room:
/// with aging A = 2 and threshold 1, X may be preempted for priority only by
/// arrivals before step (3 - 0 - 1) * A = 4 and passed in admission only by
/// arrivals up to step (3 - 0) * A = 6, so it finishes within
/// 6 + 7 arrivals * 3 steps + its own 3 steps. Without aging it never runs.
fn urgent_stream(aging: u32, steps: u64) -> (Option<u64>, Vec<u64>) {
    let mut cfg = SchedulerConfig::new(200, 4, 1, 1, 64, 40);
    cfg.enable_prefix_caching = false;
    cfg.aging_interval_steps = aging;
    cfg.priority_preemption_threshold = 1;
    cfg.max_priority_preemptions_per_step = 4;
    let mut s = Scheduler::new(cfg).unwrap();
    let p = |priority| RequestParams { max_tokens: 3, priority, ignore_eos: true, ..Default::default() };
    s.add_request("x", &[1, 2, 3], p(3)).unwrap();
    let mut x_done = None;
    let mut x_preempted_at = vec![];
    for t in 0..steps {
        if t > 0 {
            s.add_request(&format!("u{t}"), &[4, 5], p(0)).unwrap();
        }
        let out = s.schedule(t as f64).unwrap().clone();
        for (&h, &c) in out.preempted.iter().zip(&out.preempted_causes) {
            if s.request_id(h) == Some("x") && c == PreemptCause::Priority {
                x_preempted_at.push(t);
            }
        }
        let n = out.total_samples();
        let upd = s.update(&vec![9; n]).unwrap().clone();
        for &(h, _, _) in &upd.finished {
            if s.request_id(h) == Some("x") {
                x_done.get_or_insert(t);
            }
        }
    }
    (x_done, x_preempted_at)
}

#[test]
fn starvation_bound_under_an_urgent_stream() {
    let (done, preempted) = urgent_stream(2, 60);
    let done = done.expect("x never finished: starvation");
    assert!(done <= 6 + 7 * 3 + 3, "x finished at step {done}, past the bound");
    assert!(!preempted.is_empty() && preempted.iter().all(|&t| t < 4), "x preempted at {preempted:?}");
    let (done0, _) = urgent_stream(0, 60);
    assert_eq!(done0, None, "without aging the urgent stream should starve x (the bound needs aging)");
}
