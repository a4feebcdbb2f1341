//! SessionService is declared in the contract so clients can be generated
//! against it; every call answers UNIMPLEMENTED until sessions land.

use tonic::{Request, Response, Status};

use super::execution::EventStream;
use crate::pb;
use crate::pb::session_service_server::SessionService;

pub struct SessionApi;

fn not_yet() -> Status {
    Status::unimplemented("SessionService is not implemented yet; use ExecutionService for one-turn tasks")
}

#[tonic::async_trait]
impl SessionService for SessionApi {
    type SendTurnStream = EventStream;
    type WatchSessionStream = EventStream;

    async fn create_session(&self, _: Request<pb::CreateSessionRequest>) -> Result<Response<pb::Session>, Status> {
        Err(not_yet())
    }
    async fn send_turn(&self, _: Request<pb::SendTurnRequest>) -> Result<Response<EventStream>, Status> {
        Err(not_yet())
    }
    async fn watch_session(&self, _: Request<pb::WatchSessionRequest>) -> Result<Response<EventStream>, Status> {
        Err(not_yet())
    }
    async fn get_session(&self, _: Request<pb::GetSessionRequest>) -> Result<Response<pb::Session>, Status> {
        Err(not_yet())
    }
    async fn list_sessions(
        &self,
        _: Request<pb::ListSessionsRequest>,
    ) -> Result<Response<pb::ListSessionsResponse>, Status> {
        Err(not_yet())
    }
    async fn cancel_turn(&self, _: Request<pb::CancelTurnRequest>) -> Result<Response<pb::Session>, Status> {
        Err(not_yet())
    }
    async fn end_session(&self, _: Request<pb::EndSessionRequest>) -> Result<Response<pb::Session>, Status> {
        Err(not_yet())
    }
}
