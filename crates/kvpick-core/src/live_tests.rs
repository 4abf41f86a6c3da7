use std::time::Duration;

use super::live::{LiveConfig, MAX_QUEUE_TIMEOUT};
use crate::{Core, CoreConfig};

#[test]
fn a_live_update_replaces_only_the_live_part() {
    let core = Core::new(CoreConfig {
        index_max_blocks: 1234,
        ..CoreConfig::default()
    });
    let mut live = LiveConfig::of(&core.config());
    live.cost.overlap_score_credit = 2.5;
    live.busy.active_prefill_tokens = Some(10);
    live.queue_timeout = Duration::from_secs(7);
    live.session_soft_margin_blocks = 3.0;
    core.update_live_config(live).unwrap();
    let config = core.config();
    assert_eq!(LiveConfig::of(&config), live);
    assert_eq!(config.index_max_blocks, 1234, "not a live setting");
}

type Edit = fn(&mut LiveConfig);

#[test]
fn a_refused_live_update_keeps_the_previous_settings() {
    let core = Core::new(CoreConfig::default());
    let before = LiveConfig::of(&core.config());
    let cases: [(&str, Edit); 5] = [
        ("overlap_score_credit", |l| {
            l.cost.overlap_score_credit = -1.0
        }),
        ("stall_weight", |l| l.cost.stall_weight = f64::NAN),
        ("ttft_slack", |l| l.cost.ttft_slack = 0.99),
        ("sheddable_fraction", |l| l.busy.sheddable_fraction = 1.01),
        ("queue_timeout", |l| {
            l.queue_timeout = MAX_QUEUE_TIMEOUT + Duration::from_millis(1)
        }),
    ];
    for (field, edit) in cases {
        let mut live = before;
        edit(&mut live);
        let err = core.update_live_config(live).unwrap_err();
        assert_eq!(err.field, field);
        assert_eq!(LiveConfig::of(&core.config()), before);
    }
    let mut at_limit = before;
    at_limit.queue_timeout = MAX_QUEUE_TIMEOUT;
    core.update_live_config(at_limit).unwrap();
}
