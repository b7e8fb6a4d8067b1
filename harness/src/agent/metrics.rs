//! One scrape of an agent's `/metrics`, read as a user's Prometheus would: samples by series,
//! and histograms as the difference between two scrapes.

use std::time::Duration;

/// The text of one `/metrics` scrape.
#[derive(Clone, Debug)]
pub struct Scraped {
    text: String,
}

impl Scraped {
    /// GET `{url}/metrics`.
    pub async fn get(url: &str) -> anyhow::Result<Scraped> {
        let resp = reqwest::Client::new()
            .get(format!("{url}/metrics"))
            .timeout(Duration::from_secs(5))
            .send()
            .await?
            .error_for_status()?;
        Ok(Scraped { text: resp.text().await? })
    }

    /// A scrape of this exposition text.
    pub fn from_text(text: impl Into<String>) -> Scraped {
        Scraped { text: text.into() }
    }

    /// The exposition text.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The value of `series`: a metric name with its labels exactly as exposed, e.g.
    /// `etcd_mirror_batch_revisions_bucket{le="1.0"}`; None when it is not there.
    pub fn sample(&self, series: &str) -> Option<f64> {
        self.text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            (name == series).then(|| value.trim().parse().ok()).flatten()
        })
    }

    /// What the unlabelled histogram `name` observed since `earlier`, a scrape of the same
    /// agent (the counts are cumulative since its start).
    pub fn histogram_since(&self, earlier: &Scraped, name: &str) -> Observed {
        let now = self.buckets(name);
        let then = earlier.buckets(name);
        let buckets = now
            .iter()
            .map(|&(le, n)| (le, n - then.iter().find(|(l, _)| *l == le).map_or(0.0, |(_, m)| *m)))
            .collect();
        let delta = |series: &str| {
            let series = format!("{name}_{series}");
            self.sample(&series).unwrap_or(0.0) - earlier.sample(&series).unwrap_or(0.0)
        };
        Observed { buckets, count: delta("count"), sum: delta("sum") }
    }

    /// (upper bound, cumulative count) of each bucket of the histogram `name`, `+Inf` last.
    fn buckets(&self, name: &str) -> Vec<(f64, f64)> {
        let prefix = format!("{name}_bucket{{le=\"");
        let mut buckets: Vec<(f64, f64)> = self
            .text
            .lines()
            .filter_map(|l| {
                let (le, value) = l.strip_prefix(prefix.as_str())?.split_once("\"} ")?;
                let le = if le == "+Inf" { f64::INFINITY } else { le.parse().ok()? };
                Some((le, value.trim().parse().ok()?))
            })
            .collect();
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        buckets
    }
}

/// Observations of a histogram between two scrapes.
#[derive(Clone, Debug, PartialEq)]
pub struct Observed {
    /// (upper bound, cumulative count), ascending, `+Inf` last.
    pub buckets: Vec<(f64, f64)>,
    /// Observations.
    pub count: f64,
    /// Their sum.
    pub sum: f64,
}

impl Observed {
    /// The upper bound of the bucket that holds the `q` quantile (None without observations;
    /// infinite when it lies above the last finite bound): "at most this".
    pub fn quantile_at_most(&self, q: f64) -> Option<f64> {
        if self.count <= 0.0 {
            return None;
        }
        let rank = q * self.count;
        self.buckets.iter().find(|(_, n)| *n >= rank).map(|(le, _)| *le)
    }

    /// The mean observation (None without observations).
    pub fn mean(&self) -> Option<f64> {
        (self.count > 0.0).then(|| self.sum / self.count)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BEFORE: &str = "# TYPE etcd_mirror_apply_latency_seconds histogram
etcd_mirror_apply_latency_seconds_sum 1.5
etcd_mirror_apply_latency_seconds_count 10
etcd_mirror_apply_latency_seconds_bucket{le=\"0.001\"} 2
etcd_mirror_apply_latency_seconds_bucket{le=\"0.002\"} 8
etcd_mirror_apply_latency_seconds_bucket{le=\"0.004\"} 10
etcd_mirror_apply_latency_seconds_bucket{le=\"+Inf\"} 10
etcd_mirror_tls_cert_expiry_timestamp_seconds{side=\"source\",kind=\"ca\"} 1900000000
";

    const AFTER: &str = "etcd_mirror_apply_latency_seconds_sum 3.5
etcd_mirror_apply_latency_seconds_count 110
etcd_mirror_apply_latency_seconds_bucket{le=\"0.001\"} 2
etcd_mirror_apply_latency_seconds_bucket{le=\"0.002\"} 58
etcd_mirror_apply_latency_seconds_bucket{le=\"0.004\"} 107
etcd_mirror_apply_latency_seconds_bucket{le=\"+Inf\"} 110
";

    /// A series is found by its exact name and labels, never by a prefix of them.
    #[test]
    fn a_sample_is_read_by_its_whole_series() {
        let s = Scraped::from_text(BEFORE);
        assert_eq!(s.sample("etcd_mirror_apply_latency_seconds_count"), Some(10.0));
        assert_eq!(
            s.sample("etcd_mirror_tls_cert_expiry_timestamp_seconds{side=\"source\",kind=\"ca\"}"),
            Some(1.9e9)
        );
        assert_eq!(s.sample("etcd_mirror_apply_latency_seconds"), None);
        assert_eq!(s.sample("etcd_mirror_tls_cert_expiry_timestamp_seconds"), None);
    }

    /// Between two scrapes: the bucket of each quantile of the observations made in between,
    /// not of every observation since the start.
    #[test]
    fn quantiles_are_of_the_observations_between_two_scrapes() {
        let seen = Scraped::from_text(AFTER)
            .histogram_since(&Scraped::from_text(BEFORE), "etcd_mirror_apply_latency_seconds");
        assert_eq!((seen.count, seen.sum), (100.0, 2.0));
        assert_eq!(seen.quantile_at_most(0.5), Some(0.002));
        assert_eq!(seen.quantile_at_most(0.9), Some(0.004));
        assert_eq!(seen.quantile_at_most(0.99), Some(f64::INFINITY));
        assert_eq!(seen.mean(), Some(0.02));
        let none = Scraped::from_text(BEFORE)
            .histogram_since(&Scraped::from_text(BEFORE), "etcd_mirror_apply_latency_seconds");
        assert_eq!((none.quantile_at_most(0.5), none.mean()), (None, None));
    }
}
