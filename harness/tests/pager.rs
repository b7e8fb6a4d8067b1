//! The pager every reader pages with (the genesis scan, reconcile, verify) against real etcd:
//! whatever the key density, the page limits, the value sizes and the excluded prefixes, it
//! yields exactly the keys and values of the range, in key order, each once, also when resumed
//! after a cursor.

use std::collections::BTreeMap;
use std::time::Duration;

use etcd_client::{Client, TxnOp};
use harness::{ClusterSpec, EtcdCluster, EtcdVersion};
use mirror_core::{KeyRewriter, Pager, PagerOptions, Side};

/// Writes `keys` in Txns of 10 puts (10 large values stay under the request limit).
async fn put_all(client: &mut Client, keys: &BTreeMap<Vec<u8>, Vec<u8>>) {
    let puts: Vec<TxnOp> = keys.iter().map(|(k, v)| TxnOp::put(k.clone(), v.clone(), None)).collect();
    for ops in puts.chunks(10) {
        client.txn(etcd_client::Txn::new().and_then(ops.to_vec())).await.unwrap();
    }
}

/// Every key and value the pager yields, checking key order as it goes.
async fn read_all(pager: &mut Pager) -> Vec<(Vec<u8>, Vec<u8>)> {
    let mut out: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
    while let Some(page) = pager.next_page().await.unwrap() {
        for kv in page {
            if let Some((last, _)) = out.last() {
                assert!(kv.key() > last.as_slice(), "{:?} after {:?}", kv.key(), last);
            }
            out.push((kv.key().to_vec(), kv.value().to_vec()));
        }
    }
    out
}

#[tokio::test]
async fn the_pager_yields_every_key_once_in_order() {
    let source = EtcdCluster::start(ClusterSpec::new(EtcdVersion::V3_5_30)).await.unwrap();
    let mut client = source.client().await.unwrap();

    let mut mirrored = BTreeMap::new();
    // Unpadded numbers: the density seen by the stride changes along the range.
    for i in 0..3000 {
        mirrored.insert(format!("/r/a{i}").into_bytes(), format!("v{i}").into_bytes());
    }
    // A dense, padded run.
    for i in 0..2000 {
        mirrored.insert(format!("/r/m/{i:06}").into_bytes(), vec![b'm'; 64]);
    }
    // Sparse keys far apart, binary ones among them.
    for i in 0..40u8 {
        mirrored.insert([b"/r/s/".as_slice(), &[i * 6, 0xff, i]].concat(), vec![i; 10]);
    }
    // Values large enough that pages shrink to a few keys.
    for i in 0..40 {
        mirrored.insert(format!("/r/z/big{i:03}").into_bytes(), vec![b'z'; 100 << 10]);
    }
    let mut excluded = BTreeMap::new();
    for i in 0..500 {
        excluded.insert(format!("/r/m/skip/{i:04}").into_bytes(), b"no".to_vec());
    }
    put_all(&mut client, &mirrored).await;
    put_all(&mut client, &excluded).await;
    let want: Vec<(Vec<u8>, Vec<u8>)> = mirrored.into_iter().collect();

    let windows = KeyRewriter::new(b"/r/", b"/r/", [&b"m/skip/"[..]]).scan_windows();
    assert!(windows.len() >= 2, "the exclude splits the range: {windows:?}");
    for (key_limit, page_bytes) in [(512, 1 << 20), (64, 256 << 10), (7, 1 << 20), (4096, 1 << 20)] {
        let opts = PagerOptions::new("test page", key_limit, page_bytes, Duration::from_secs(10));
        let mut pager = Pager::new(client.kv_client(), Side::Source, windows.clone(), opts);
        let got = read_all(&mut pager).await;
        let case = format!("key_limit {key_limit}, page_bytes {page_bytes}");
        assert_eq!(got.len(), want.len(), "{case}");
        assert!(got == want, "{case}: the keys or values differ");

        // Resumed after a cursor in the middle, it yields exactly the rest.
        let cursor = &want[want.len() / 3].0;
        let opts = PagerOptions::new("test page", key_limit, page_bytes, Duration::from_secs(10));
        let mut pager =
            Pager::new(client.kv_client(), Side::Source, windows.clone(), opts).resume_after(cursor);
        let rest = read_all(&mut pager).await;
        assert!(rest == want[want.len() / 3 + 1..], "{case}: resumed after {cursor:?}");
    }
}
