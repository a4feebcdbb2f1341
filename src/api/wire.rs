//! A streamed `LifecycleEvent` as the daemon sends it: bytes, encoded once.
//!
//! A thousand watchers of one execution get the same event a thousand
//! times. Converting and encoding it for each would be most of the work of
//! a fanout, so the services of [`crate::pb_wire`] stream [`WireEvent`]s:
//! the message already encoded, which tonic's codec copies into each
//! stream's frame as it is. A live event without its raw part (what every
//! watcher gets) is encoded by the first stream that sends it and shared
//! with every other (see [`crate::events::BusItem::wire`]); an event with
//! the direct caller's raw part is encoded for that caller alone.
//!
//! On the wire nothing changes: the bytes are exactly the message's
//! encoding, and every client decodes them as a `pb::LifecycleEvent`.

use std::marker::PhantomData;
use std::sync::Arc;

use bytes::{BufMut, Bytes};
use tonic::codec::{BufferSettings, Codec};
use tonic_prost::{ProstDecoder, ProstEncoder};

use super::convert;
use crate::events::BusItem;
use crate::pb;

/// An encoded `pb::LifecycleEvent`.
#[derive(Clone, Debug)]
pub struct WireEvent(Encoded);

/// Two are equal when their encodings are.
impl PartialEq for WireEvent {
    fn eq(&self, other: &Self) -> bool {
        self.bytes() == other.bytes()
    }
}

#[derive(Clone, Debug)]
enum Encoded {
    /// The item's shared encoding, always set: held through the item's own
    /// count, so handing it over takes no further count on the bytes (a
    /// thousand watchers on two cores would bounce that count).
    Shared(Arc<crate::events::SharedEvent>),
    /// An encoding of this stream's own.
    Own(Bytes),
}

impl Default for WireEvent {
    fn default() -> Self {
        WireEvent(Encoded::Own(Bytes::new()))
    }
}

impl WireEvent {
    /// The event of `item`, encoded: shared when it has no raw part.
    pub fn of(item: BusItem) -> WireEvent {
        match item.raw {
            None => {
                item.wire().get_or_init(|| encode(&convert::event(&item)));
                WireEvent(Encoded::Shared(item.into_shared()))
            }
            Some(_) => WireEvent(Encoded::Own(encode(&convert::event(&item)))),
        }
    }

    /// The encoded message.
    pub fn bytes(&self) -> &[u8] {
        match &self.0 {
            Encoded::Shared(shared) => shared.wire().get().map(|b| &b[..]).unwrap_or_default(),
            Encoded::Own(bytes) => bytes,
        }
    }
}

fn encode(event: &pb::LifecycleEvent) -> Bytes {
    Bytes::from(prost::Message::encode_to_vec(event))
}

impl prost::Message for WireEvent {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        buf.put_slice(self.bytes());
    }

    /// The daemon never decodes one (it only sends them): any field is
    /// skipped.
    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: prost::encoding::WireType,
        buf: &mut impl bytes::Buf,
        ctx: prost::encoding::DecodeContext,
    ) -> Result<(), prost::DecodeError> {
        prost::encoding::skip_field(wire_type, tag, buf, ctx)
    }

    fn encoded_len(&self) -> usize {
        self.bytes().len()
    }

    fn clear(&mut self) {
        *self = WireEvent::default();
    }
}

/// The buffer each stream encodes its messages into, handed to HTTP/2 as
/// one frame (tonic's default is 8 KiB, handed over at 32 KiB). Each open
/// stream holds up to this much on top of h2's send buffer, so a watcher
/// that is behind costs the sum of the two.
const STREAM_BUFFER: usize = 4 << 10;

/// A frame is handed over once it holds this much: a message's room short
/// of [`STREAM_BUFFER`]. Handed over only past the buffer's size, a frame
/// of events that were all ready (a watcher catching up) outgrows its
/// buffer and holds one of twice the size until it is written, over every
/// frame a watcher has waiting in h2's send buffer: 68-72 KiB of daemon
/// memory per watcher at W = 1,000 against 51 with this.
const STREAM_CHUNK: usize = STREAM_BUFFER - 512;

/// The services' codec: prost's, with each stream's encode buffer and
/// frame bounded by [`STREAM_BUFFER`] (requests decode as prost's do).
pub struct WireCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for WireCodec<T, U> {
    fn default() -> Self {
        WireCodec(PhantomData)
    }
}

impl<T, U> Codec for WireCodec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = ProstDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::new(BufferSettings::new(STREAM_BUFFER, STREAM_CHUNK))
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstDecoder::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::{Event, EventKind};

    fn item(raw: Option<crate::events::RawPart>) -> BusItem {
        let event = Event {
            subject_id: "e1".into(),
            sequence: 7,
            time_ms: 1_000,
            kind: EventKind::Progress { progress_kind: "tool_use".into(), tool: "Bash".into(), tokens_so_far: 40 },
        };
        BusItem::new(Arc::new(event), raw.map(Arc::new))
    }

    #[test]
    fn a_wire_event_is_the_message_encoding_exactly_and_decodes_as_one() {
        let item = item(None);
        let wire = WireEvent::of(item.clone());
        let expected = prost::Message::encode_to_vec(&convert::event(&item));
        assert_eq!(prost::Message::encode_to_vec(&wire), expected);
        let decoded: pb::LifecycleEvent = prost::Message::decode(expected.as_slice()).unwrap();
        assert_eq!(decoded, convert::event(&item));
    }

    #[tokio::test]
    async fn a_frame_of_events_that_were_all_ready_never_outgrows_its_buffer() {
        use http_body_util::BodyExt;
        // A watcher catching up: every event is ready when the encoder asks.
        let events: Vec<Result<WireEvent, tonic::Status>> = (1..=400)
            .map(|sequence| {
                let event = Event { sequence, ..item(None).event().clone() };
                Ok(WireEvent::of(BusItem::new(Arc::new(event), None)))
            })
            .collect();
        // Each message: a 5-byte gRPC header and the event.
        let total: usize = events.iter().map(|e| 5 + e.as_ref().unwrap().bytes().len()).sum();
        let encoder = WireCodec::<WireEvent, pb::LifecycleEvent>::default().encoder();
        let override_ = tonic::codec::SingleMessageCompressionOverride::default();
        let body =
            tonic::codec::EncodeBody::new_server(encoder, futures_util::stream::iter(events), None, override_, None);
        let mut body = std::pin::pin!(body);
        let mut frames = Vec::new();
        while let Some(frame) = body.frame().await {
            if let Ok(data) = frame.unwrap().into_data() {
                frames.push(data.len());
            }
        }
        assert_eq!(frames.iter().sum::<usize>(), total, "every event, once");
        let (last, full) = frames.split_last().unwrap();
        assert!(*last <= STREAM_BUFFER);
        for &len in full {
            assert!((STREAM_CHUNK..=STREAM_BUFFER).contains(&len), "a {len}-byte frame: {frames:?}");
        }
    }

    #[test]
    fn watchers_share_one_encoding_and_the_direct_caller_gets_its_own() {
        let shared = item(None);
        let copy = shared.clone();
        let (a, b) = (WireEvent::of(shared.clone()), WireEvent::of(copy));
        assert_eq!(a.bytes().as_ptr(), b.bytes().as_ptr(), "encoded once, the same bytes for both");
        assert_eq!(shared.wire().get().map(|b| b.as_ptr()), Some(a.bytes().as_ptr()), "the item's own encoding");
        let direct = item(Some(crate::events::RawPart::ProgressMessage("the harness's own words".into())));
        let raw = WireEvent::of(direct.clone());
        assert!(direct.wire().get().is_none(), "a raw part is never put in the shared encoding");
        assert_ne!(raw.bytes(), WireEvent::of(item(None)).bytes());
    }
}
